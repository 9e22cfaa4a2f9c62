"""Sampling with vLLM inside the training process (TRL's ``vllm_mode="colocate"``)."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_vlm.generation.base import Rollouts, SamplingSettings
from lightning_vlm.generation.vllm_engine import (
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
from lightning_vlm.generation.weight_sync import reset_vllm_caches, save_adapter, sync_colocated

log = logging.getLogger(__name__)
MODEL_IMPLS = ("auto", "vllm", "transformers")
# "processed": log-probs of the distribution actually sampled (suppression, temperature, top-k/p),
# the same quantity HFGenerator returns, so the IS ratio compares like with like.
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
# "merged": full weights with LoRA merged in (any model); "adapter": only the LoRA adapter is pushed
# and vLLM applies it (TRL #5975: far less to move for big models; needs every base weight frozen).
WEIGHT_SYNCS = ("merged", "adapter")


def check_engine_settings(
    gpu_memory_utilization: float, max_model_len: int, tensor_parallel_size: int, model_impl: str
) -> None:
    """Refuse bad engine settings with an error naming the setting."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")


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
    config = vlm.model.peft_config[vlm.model.active_adapter]
    rank = 8  # vLLM accepts ranks 8, 16, 32, ...: the smallest that holds the adapter
    while rank < int(config.r):
        rank *= 2
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


class VLLMColocateGenerator:
    """A ``Generator`` backed by an in-process ``vllm.LLM`` holding a copy of the policy.

    Behaves like ``HFGenerator`` (same suppressed vision tokens, stop at end-of-turn, G consecutive
    completions per row) but samples from vLLM's copy of the weights: ``is_policy`` is
    False and ``Rollouts.logprobs`` are vLLM's, for the importance-sampling correction.
    """

    is_policy = False

    def __init__(
        self,
        vlm: Any,
        model_path: str | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        dtype: str = "auto",
        model_impl: str = "vllm",
        limit_mm_per_prompt: dict[str, int] | None = None,
        logprobs_mode: str = "processed_logprobs",
        weight_sync: str = "merged",
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        check_engine_settings(gpu_memory_utilization, max_model_len, tensor_parallel_size, model_impl)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}")
        self.vlm = vlm
        self.weight_sync = weight_sync
        if weight_sync == "adapter":
            engine_kwargs = {**adapter_engine_options(vlm), **engine_kwargs}
        self._adapter: Any = None
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="lightning-vlm-lora-")
        self.on_gpu = has_cuda()
        self.sleep_enabled = bool(enable_sleep_mode and self.on_gpu)
        if enable_sleep_mode and not self.on_gpu:
            log.info("enable_sleep_mode: vLLM sleeps only on GPU; ignored on CPU")
        # Weights go in through an in-process iterator: keep the engine core in this process
        # (TRL's colocate mode does the same). With tensor parallelism the workers are separate
        # processes anyway and the weights travel as a list.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.in_process = tensor_parallel_size == 1
        self.llm = make_vllm_engine(
            model_path or vlm.model_name_or_path,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=self.sleep_enabled,
            model_impl=model_impl,
            limit_mm_per_prompt=limit_mm_per_prompt,
            seed=seed,
            logprobs_mode=logprobs_mode,
            **engine_kwargs,
        )
        self.asleep = False
        self.seed: int | None = None
        if model_impl == "transformers":
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
        # Templated text with one placeholder per image + PIL images: vLLM expands them itself.
        requests = [vllm_inputs(vlm.processor, r["prompt"], r.get("images", [])) for r in rows]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._adapter)
        ids, logprobs = completions_of(outputs)
        return build_rollouts(
            rows, num_generations, ids, logprobs, vlm.end_of_turn_id, vlm.tokenizer, "vllm_colocate"
        )

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
