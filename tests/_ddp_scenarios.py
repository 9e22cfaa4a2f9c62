"""Scenarios run on 2 processes by torchrun (the tests compare them with one-process runs):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/_ddp_scenarios.py OUT NAME...

``equivalence:<name>`` trains ``ddp_helpers.EQUIVALENCE[name]`` and writes ``OUT/<name>.pt``
(``fsdp:<name>``: the same under FSDP, ``OUT/fsdp_<name>.pt``);
``rows`` records each rank's rows over one epoch, and over an interrupted and resumed epoch
(``fsdp_rows`` under FSDP, ``fsdp_ref_sync_rows`` the same with DPO and TR-DPO's reference syncs);
``fsdp_export`` writes ExportHFModel's folders from FSDP runs (full weights, LoRA merged);
``learn:<generation>:<warm start>`` runs GRPO from the warm start and writes the reward before and
after; ``server:<warm start>`` runs a few steps against one vLLM server (parity after each push);
``server_push_fails:<warm start>`` fails rank 0's second push and records how each rank ended.
A failing scenario is written to ``OUT/<name>.error`` (rank 0) and the next one still runs.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ddp_helpers import (  # noqa: E402
    COMMON,
    EQUIVALENCE,
    EXPORTS,
    TWO_PROCESSES,
    TWO_PROCESSES_FSDP,
    correction_inputs,
    learning_overrides,
)

from helpers import REF_SYNC, compose_train  # noqa: E402
from lightning_vlm.training import train  # noqa: E402

ROWS = [
    "method=sft", "logger=none", "callbacks=none", "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "data.synthetic.num_train=24", *TWO_PROCESSES,
]  # fmt: skip

# DPO with TR-DPO's syncs every 2 steps: the resume's checkpoint (step 3) holds the reference moved at step 2
REF_SYNC_ROWS = ("method=dpo", REF_SYNC[0], "+callbacks.sync_ref.sync_steps=2", REF_SYNC[2])


def equivalence(name: str, out: Path, strategy: str = "ddp") -> None:
    world = TWO_PROCESSES if strategy == "ddp" else TWO_PROCESSES_FSDP
    tag = name if strategy == "ddp" else f"{strategy}_{name}"
    overrides = [*COMMON, *EQUIVALENCE[name], *world]
    overrides += ["+callbacks.save._target_=ddp_helpers.SaveWeights", f"+callbacks.save.path={out / tag}.pt"]
    metrics, _ = train(compose_train(overrides, out / tag))
    if int(os.environ.get("RANK", "0")) == 0:  # what rank 0 logged: the values a user's logger shows
        (out / f"{tag}.metrics.json").write_text(json.dumps({k: float(v) for k, v in metrics.items()}))


def rows(out: Path, strategy: str = "ddp", method: tuple[str, ...] = (), tag: str | None = None) -> None:
    """One whole epoch (6 steps of 2 × 2 rows); then the same epoch stopped after 3 steps and resumed
    (under FSDP from sharded checkpoints: one file per rank). ``method``: another method's overrides."""
    tag = tag or ("rows" if strategy == "ddp" else f"{strategy}_rows")
    world = ROWS if strategy == "ddp" else [o for o in ROWS if o not in TWO_PROCESSES] + TWO_PROCESSES_FSDP
    world = [o for o in world if not (method and o == "method=sft")] + list(method)
    record = "+callbacks.rows._target_=ddp_helpers.RecordRows"
    save = "+callbacks.save._target_=ddp_helpers.SaveWeights"
    whole = [*world, "trainer.max_steps=6", record, f"+callbacks.rows.dirpath={out / f'{tag}_whole'}",
             save, f"+callbacks.save.path={out / f'{tag}_whole.pt'}"]  # fmt: skip
    train(compose_train(whole, out / f"{tag}_whole"))
    ckpt = out / f"{tag}_ckpt"
    first = [*world, "trainer.max_steps=3", record, f"+callbacks.rows.dirpath={out / f'{tag}_first'}",
             "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint", f"+callbacks.ckpt.dirpath={ckpt}",
             "+callbacks.ckpt.every_n_train_steps=3", "+callbacks.ckpt.filename=mid"]  # fmt: skip
    train(compose_train(first, out / f"{tag}_first"))
    second = [*world, "trainer.max_steps=6", record, f"+callbacks.rows.dirpath={out / f'{tag}_second'}",
              f"ckpt_path={ckpt / 'mid.ckpt'}", save, f"+callbacks.save.path={out / f'{tag}_resumed.pt'}"]  # fmt: skip
    train(compose_train(second, out / f"{tag}_second"))


def learn(generation: str, warm: str, out: Path) -> None:
    """GRPO from the warm start on 2 processes; rank 0 writes the sampled accuracy reward before and after."""
    folder = out / f"learn_{generation}"
    metrics, objects = train(compose_train(learning_overrides(warm, generation, folder), folder))
    if objects["trainer"].is_global_zero:
        key = "val/rewards/accuracy_reward"
        result = {"before": objects["initial_metrics"][key], "after": metrics[key]}
        (folder / "result.json").write_text(__import__("json").dumps(result))


def server(warm: str, out: Path) -> None:
    """A few GRPO steps of 2 processes against one server that rank 0 starts; parity after each push."""
    folder = out / "server"
    # Its validation (8 prompts: no test reads its values) is the only one through a server on 2 ranks.
    overrides = [*learning_overrides(warm, "vllm_server", folder), "callbacks.vllm_generation.start_server=true",
                 "trainer.limit_train_batches=4", "trainer.val_check_interval=4", "validate_before_fit=false",
                 "callbacks.parity.every=1", "data.synthetic.num_val=8"]  # fmt: skip
    train(compose_train(overrides, folder))


def server_push_fails(warm: str, out: Path) -> None:
    """Rank 0's second weight push fails (a fault injected where the server would refuse it): each rank
    writes the error it ended with to ``push_fails/rank<r>.json`` instead of waiting for a version."""
    from lightning_vlm.generation.vllm_server import VLLMServerGenerator
    from lightning_vlm.generation.vllm_server_client import VLLMServerError

    folder = out / "push_fails"
    original, pushes = VLLMServerGenerator.sync_weights, []

    def refused(self, *args, **kwargs):
        pushes.append(1)
        if len(pushes) == 2:
            raise VLLMServerError("injected: the server refused the update")
        return original(self, *args, **kwargs)

    VLLMServerGenerator.sync_weights = refused
    overrides = [*learning_overrides(warm, "vllm_server", folder), "callbacks.vllm_generation.start_server=true",
                 "trainer.limit_train_batches=4", "trainer.val_check_interval=4", "validate_before_fit=false"]  # fmt: skip
    try:
        train(compose_train(overrides, folder))
        ended = {"error": None}
    except Exception as exc:
        ended = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        VLLMServerGenerator.sync_weights = original
    rank = torch.distributed.get_rank()
    (folder / f"rank{rank}.json").write_text(json.dumps(ended))


def fsdp_vllm(mode: str, out: Path) -> None:
    """GRPO under FSDP with vLLM (colocated full or adapter sync, or a server): parity after each sync,
    and the units the sync gathers one at a time."""
    folder = out / f"fsdp_vllm_{mode}"
    generation = "vllm_server" if mode == "server" else "vllm_colocate"
    overrides = [
        "method=grpo", f"generation={generation}", "logger=none", "callbacks=none", "trainer.max_steps=4",
        "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "method.num_generations=4",
        *TWO_PROCESSES_FSDP, "+callbacks.parity._target_=ddp_probes.ParityProbe", f"+callbacks.parity.dirpath={folder}",
        "+callbacks.chunks._target_=ddp_probes.UnitChunks", f"+callbacks.chunks.dirpath={folder}",
    ]  # fmt: skip
    if mode == "adapter":
        overrides += [
            "lora=default",
            "model.lora.modules_to_save=null",
            "callbacks.vllm_generation.weight_sync=adapter",
        ]
    if mode == "server":
        # A request the tiny model answers in seconds: a stuck server fails the run with its error
        # (and the test shows the server's log) well before the launcher's timeout.
        overrides += ["callbacks.vllm_generation.start_server=true", "callbacks.vllm_generation.server_timeout=120",
                      "callbacks.vllm_generation.retries=0", "callbacks.vllm_generation.reconnect_timeout=60"]  # fmt: skip
    train(compose_train(overrides, folder))


def fsdp_export(out: Path) -> None:
    """SFT under FSDP with ExportHFModel, full weights and LoRA merged: every rank takes part in the
    gather, rank 0 writes ``OUT/fsdp_export_<variant>/hf_model``."""
    for variant, extra in EXPORTS.items():
        folder = out / f"fsdp_export_{variant}"
        overrides = [*COMMON, *EQUIVALENCE["sft"], *TWO_PROCESSES_FSDP, *extra,
                     "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                     f"+callbacks.export.dirpath={folder / 'hf_model'}"]  # fmt: skip
        train(compose_train(overrides, folder))


def collectives(out: Path) -> None:
    """The collectives with a different number of rows on each rank (rank r holds r + 1)."""
    import torch.distributed as dist

    from lightning_vlm.losses.importance import rollout_correction
    from lightning_vlm.methods.online_metrics import pooled_correction
    from lightning_vlm.parallel.collectives import (
        Shard,
        all_gather_object,
        gather_cat,
        mean_normalizer,
        pooled_means,
    )

    dist.init_process_group("gloo") if not dist.is_initialized() else None
    r = dist.get_rank()
    rows = torch.arange(r + 1, dtype=torch.float32) + 10 * r
    shard = Shard.exchange(len(rows))
    # rank 1 without rows (its mean NaN) adds nothing: rank 0's mean, not NaN on both
    one_empty = ({"mean": rows[:0].mean()}, 0) if r else ({"mean": rows.mean() + 5}, 1)
    result = {
        "gathered": gather_cat(rows.unsqueeze(-1).repeat(1, 3)).tolist(),
        "sizes": list(shard.sizes), "offset": shard.offset, "local": shard.local(shard.gather(rows)).tolist(),
        "normalizer": float(mean_normalizer(len(rows))), "objects": all_gather_object({"rank": r}),
        "pooled": float(pooled_means({"mean": rows.mean()}, len(rows))["mean"]),
        "pooled_one_empty": float(pooled_means(*one_empty)["mean"]),
    }  # fmt: skip
    # the rollout correction's metrics; then with rank 1 holding no rows
    for level in ("token", "sequence"):
        for tag, rows in (("", None), ("_one_empty", 0 if r else None)):
            old, sampler, mask = correction_inputs(r, rows)
            _, metrics = rollout_correction(old, sampler, mask, level, "truncate", clip_max=1.5)
            pooled = pooled_correction(metrics, mask, level)
            result[f"correction_{level}{tag}"] = {k: float(v) for k, v in pooled.items()}
    result["head_chunks"] = head_chunks(r)
    result["ddp_one_empty"] = ddp_one_empty(r)
    (out / f"collectives-rank{r}.json").write_text(json.dumps(result))


class GatheringHead(torch.nn.Linear):
    """An LM head whose every call makes a collective, as DeepSpeed ZeRO-3's hooks gather its weight."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        GatheringHead.calls += 1
        dist.all_reduce(self.weight.detach().clone())
        return super().forward(x)


def head_chunks(r: int) -> dict[str, list]:
    """Per case: head calls in forward, in forward and backward, and whether the log-probs are right. Rank 0
    scores 10 tokens (3 chunks of 4), rank 1 three or none: 1 chunk or 0, and the job hung."""
    from lightning_vlm.models.logprobs import selective_logps

    torch.manual_seed(0)
    head, result = GatheringHead(8, 16), {}
    for case, n in (("uneven", 10 if r == 0 else 3), ("one_empty", 10 if r == 0 else 0)):
        generator = torch.Generator().manual_seed(r)
        hidden = torch.randn(n, 8, generator=generator).requires_grad_()
        targets = torch.randint(16, (n,), generator=generator)
        GatheringHead.calls = 0
        logps, _, _ = selective_logps(hidden, targets, head, chunk_size=4, agree_chunks=True)
        forward = GatheringHead.calls
        logps.sum().backward()  # each chunk's logits recomputed (checkpointed): the head runs again
        expected = torch.log_softmax(hidden.detach() @ head.weight.T + head.bias, -1)[
            torch.arange(n), targets
        ]
        result[case] = [forward, GatheringHead.calls, bool(torch.allclose(logps, expected))]
    return result


class ScoringToy(torch.nn.Module):
    """A backbone and an LM head, scored as the methods score completions (``selective_logps``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from lightning_vlm.models.logprobs import selective_logps

        return selective_logps(self.body(x), targets, self.head, chunk_size=4)[0].sum()


def ddp_one_empty(r: int) -> list[list[float]]:
    """Two DDP steps (find_unused_parameters=False, as conf/trainer/ddp.yaml) in which rank 1 scores no
    token, as when every completion of its micro-batch is masked as truncated. Its head got no gradient,
    so DDP never reduced the head's bucket: rank 0 waited for it, and the job hung. Returns the head's
    gradient in the last step, and (rank 0) that of its tokens alone, without DDP."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    local = ScoringToy()
    model = DistributedDataParallel(copy.deepcopy(local), find_unused_parameters=False)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        n = 5 if r == 0 else 0
        x, targets = torch.randn(n, 8, generator=generator), torch.randint(16, (n,), generator=generator)
        model.zero_grad()
        model(x, targets).backward()
        local.zero_grad()
        local(x, targets).backward()
    return [model.module.head.weight.grad.flatten().tolist(), local.head.weight.grad.flatten().tolist()]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    for name in sys.argv[2:]:
        try:
            if name.startswith("equivalence:"):
                equivalence(name.split(":", 1)[1], out)
            elif name.startswith("fsdp:"):
                equivalence(name.split(":", 1)[1], out, strategy="fsdp")
            elif name == "rows":
                rows(out)
            elif name == "fsdp_rows":
                rows(out, strategy="fsdp")
            elif name == "fsdp_ref_sync_rows":
                rows(out, "fsdp", REF_SYNC_ROWS, tag=name)
            elif name == "fsdp_export":
                fsdp_export(out)
            elif name == "collectives":
                collectives(out)
            elif name.startswith("learn:"):
                _, generation, warm = name.split(":", 2)
                learn(generation, warm, out)
            elif name.startswith("fsdp_vllm:"):
                fsdp_vllm(name.split(":", 1)[1], out)
            elif name.startswith("server:"):
                server(name.split(":", 1)[1], out)
            elif name.startswith("server_push_fails:"):
                server_push_fails(name.split(":", 1)[1], out)
            else:
                raise ValueError(f"unknown scenario {name!r}")
        except Exception:
            if rank == 0:
                (out / f"{'_'.join(name.split(':')[:2])}.error").write_text(traceback.format_exc())
            raise
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
