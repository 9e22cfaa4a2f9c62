"""Callbacks that probe a multi-process run from inside: vLLM parity after each weight sync (and the
engine each rank built), and the FSDP units the sync gathers one at a time."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from ddp_helpers import full_weights

from lightning_vlm.generation.base import SamplingSettings


class ParityProbe(L.Callback):
    """After every weight sync, the vLLM engine's greedy completions of this rank's batch against HF
    generate's on the trainer's weights; writes ``<dirpath>/parity-rank<r>.json`` at the end of fit."""

    def __init__(self, dirpath: str, every: int = 1, max_new_tokens: int = 8) -> None:
        self.dirpath, self.every, self.max_new_tokens = Path(dirpath), every, max_new_tokens
        self.results: list[dict] = []
        self.engine: dict = {}  # a colocated engine's executor and the rank and device index it was given

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Runs after VLLMGeneration's hook (callbacks run in order): the engine holds this step's weights.
        if trainer.global_step % self.every:
            return
        from lightning_vlm.generation.hf import HFGenerator

        llm = getattr(pl_module.generator, "llm", None)
        if llm is not None and not self.engine:
            worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
            backend = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
            self.engine = {"backend": backend, "rank": worker.rank, "local_rank": worker.local_rank}
        greedy = SamplingSettings(max_new_tokens=self.max_new_tokens, temperature=0.0, do_sample=False)
        engine = pl_module.generator.generate(batch, 1, greedy)
        with full_weights(trainer):
            hf = HFGenerator(pl_module.vlm).generate(batch, 1, greedy)
        self.results.append({"step": trainer.global_step, "vllm": engine.completion_ids, "hf": hf.completion_ids,
                             "weight_version": engine.extras.get("weight_version")})  # fmt: skip

    def on_fit_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"parity-rank{trainer.global_rank}.json").write_text(json.dumps(self.results))
        (self.dirpath / f"engine-rank{trainer.global_rank}.json").write_text(json.dumps(self.engine))


class UnitChunks(L.Callback):
    """At the end of fit (FSDP): the sizes of the units ``unit_state_chunks`` gathers one by one, and
    whether together they are exactly the full state; rank 0 writes ``<dirpath>/chunks.json``."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_fit_end(self, trainer, pl_module) -> None:
        from lightning_vlm.parallel.fsdp import clean_name, sharded_root, unit_state_chunks

        root = sharded_root(trainer.strategy.model)
        sizes, union = [], {}
        for chunk in unit_state_chunks(root, pl_module.vlm.model):
            sizes.append(sum(t.numel() for t in chunk.values()))
            union.update(chunk)
        with full_weights(trainer):
            full = {clean_name(n): p.detach().clone()
                    for n, p in pl_module.vlm.model.named_parameters(remove_duplicate=False)}  # fmt: skip
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            same = union.keys() >= full.keys() and all(torch.equal(union[k], v) for k, v in full.items())
            total = sum(p.numel() for p in full.values())
            (self.dirpath / "chunks.json").write_text(
                json.dumps({"sizes": sizes, "total": total, "same": same})
            )


# ---- learning on two processes: GRPO from the SFT warm start, as tests/test_online_learns.py ------------
