"""The vLLM engine settings, defined once.

The callback (``callbacks.vllm``), the colocated generator, the engine factory (``make_vllm_engine``)
and the server it can start all take one ``EngineOptions``; the Hydra node
``callbacks.vllm_generation.engine`` is built from this dataclass (``lightning_vlm.config``), so its
keys and defaults are the fields below. Names follow TRL's ``vllm_*`` options where TRL has one.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODEL_IMPLS = ("auto", "vllm", "transformers")
# "processed": log-probs of the distribution actually sampled (suppression, temperature, top-k/p),
# the same quantity HFGenerator returns, so the IS ratio compares like with like.
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A Hydra node (nested ones too, e.g. ``size: {longest_edge: 448}``) as plain dicts: vLLM and the
    server's JSON command line take no DictConfig."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(mapping, resolve=True) if isinstance(mapping, DictConfig) else dict(mapping)


@dataclass
class EngineOptions:
    """How a vLLM engine is built. ``dtype="auto"``: the checkpoint's on GPU, float32 on CPU;
    ``limit_mm_per_prompt`` None: ``vllm_engine.IMAGES_ONLY``; ``enable_sleep_mode``: GPU only
    (free vLLM's memory during the backward pass); ``mm_processor_kwargs`` None: the policy's
    ``model.processor_kwargs`` (:meth:`for_policy`), so vLLM sees the image tokens training sees;
    ``max_model_len`` None: the model's own context length on GPU (vLLM's and TRL's
    ``vllm_max_model_len`` default; a fixed cap cut long image prompts), ``vllm_engine.CPU_MAX_MODEL_LEN``
    on CPU; ``gpu_memory_utilization``: TRL's ``vllm_gpu_memory_utilization`` (ignored on CPU);
    ``model_impl``: vLLM's own model code, or ``transformers``'s; ``logprobs_mode``: see ``LOGPROBS_MODES``;
    ``extra``: any other ``vllm.LLM`` keyword."""

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    dtype: str = "auto"
    model_impl: str = "vllm"
    # Mappings or None, annotated Any: OmegaConf cannot merge a command-line dict into a typed dict node
    # that is None (or, in Hydra's struct mode, into an empty one), so `...engine.limit_mm_per_prompt=
    # {image:6}` failed; an Any node takes it.
    limit_mm_per_prompt: Any = None
    logprobs_mode: str = "processed_logprobs"
    seed: int | None = 0  # None (a run with seed=null): a fresh random seed, as vLLM takes only ints
    mm_processor_kwargs: Any = None
    # vLLM's cache of processed images (vLLM: 4 GiB, once in the front end and once in the engine core).
    # Off, as verl and EasyR1 set it for VLM rollouts (verl #2068: host memory grew with it on) and NeMo-RL
    # does: an RL prompt's image rarely comes back within the cache's few hundred large images, so it holds
    # memory on every rank for few hits. ms-swift's vllm_mm_processor_cache_gb.
    mm_processor_cache_gb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.seed is None:
            self.seed = secrets.randbelow(2**31)
        # Refused here, with the setting's name, rather than deep inside vLLM's engine start.
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0 (0: off), got {self.mm_processor_cache_gb}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

    @classmethod
    def build(
        cls, options: EngineOptions | Mapping[str, Any] | None = None, **overrides: Any
    ) -> EngineOptions:
        """``options`` as ``EngineOptions`` (a Hydra node arrives as a mapping), with ``overrides`` applied."""
        if options is None:
            options = cls()
        elif not isinstance(options, EngineOptions):
            values = dict(options)
            values["extra"] = _plain(values.get("extra") or {})  # nested too: compilation_config={...}
            for key in ("limit_mm_per_prompt", "mm_processor_kwargs"):
                if values.get(key) is not None:
                    values[key] = _plain(values[key])
            options = cls(**values)
        return dataclasses.replace(options, **overrides) if overrides else options

    def overrides(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The names of the fields (but ``skip``) set to other values than their defaults."""
        changed = []
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name not in skip and getattr(self, f.name) != default:
                changed.append(f.name)
        return changed

    def for_policy(self, processor_kwargs: Mapping[str, Any] | None) -> EngineOptions:
        """These options with ``mm_processor_kwargs`` defaulting to the policy's processor settings.

        The trainer's processor is built with ``model.processor_kwargs`` (e.g. Qwen2.5-VL's
        ``max_pixels``); vLLM builds its own from the checkpoint alone. Without the same settings it
        would encode images into other (often many more) tokens than training scores.
        """
        if self.mm_processor_kwargs is not None or not processor_kwargs:
            return self
        return dataclasses.replace(self, mm_processor_kwargs=dict(processor_kwargs))

    def server_args(self) -> list[str]:
        """The same settings as ``vllm serve`` options (for the server the callback starts)."""
        args = ["--dtype", self.dtype,
                "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                "--tensor-parallel-size", str(self.tensor_parallel_size), "--model-impl", self.model_impl,
                "--logprobs-mode", self.logprobs_mode, "--seed", str(self.seed),
                "--mm-processor-cache-gb", str(self.mm_processor_cache_gb)]  # fmt: skip
        if self.max_model_len is not None:  # else the server's own default, as in-process
            args += ["--max-model-len", str(self.max_model_len)]
        if self.limit_mm_per_prompt:
            args += ["--limit-mm-per-prompt", json.dumps(dict(self.limit_mm_per_prompt))]
        if self.mm_processor_kwargs:
            args += ["--mm-processor-kwargs", json.dumps(dict(self.mm_processor_kwargs))]
        if self.enable_sleep_mode:
            args.append("--enable-sleep-mode")
        return args  # ``extra`` stays in-process: a server takes its own options (``server_args``)
