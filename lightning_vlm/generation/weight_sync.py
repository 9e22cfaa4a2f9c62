"""Pushing the policy's weights into vLLM: merged LoRA, vLLM's names, and the cache resets it needs.

Every path ends in vLLM's in-place ``reload_weights`` (the only update that measured to take effect
on the CPU backend, which pre-packs its linear weights), followed by resetting the encoder and prefix
caches: cached image embeddings and KV blocks were computed with the old weights, and a stale encoder
cache kills the next image request ("Encoder cache miss").
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_vlm.models.weight_names import hf_to_vllm_names

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"


def _lora_merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``<module>.base_layer.weight`` -> base weight + the active adapters' delta, for every LoRA layer.

    Computed beside the model (the training weights are never touched): merge/unmerge in place
    would leave float rounding in the base weights after each sync.
    """
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if getattr(module, "lora_magnitude_vector", None):
            raise NotImplementedError(f"DoRA layer {name!r}: weight sync supports plain LoRA only")
        weight = module.get_base_layer().weight.detach()
        if not module.merged and not module.disable_adapters:
            delta = sum(
                module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A
            )
            weight = weight + delta if torch.is_tensor(delta) else weight
        merged[f"{name}.base_layer.weight"] = weight
    return merged


def policy_weights(vlm: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights under vLLM's names, LoRA adapters merged in (not in place)."""
    model = vlm.model
    merged = _lora_merged_weights(model) if vlm.is_lora else {}

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():
            if ".lora_" in name or ".original_module." in name:
                continue  # adapter factors are merged above; PEFT's untouched copy is not the policy
            yield name.replace(".modules_to_save.default.", "."), merged.get(name, tensor).detach()

    return hf_to_vllm_names(vlm.model_type, items())


def reset_vllm_caches(llm: Any) -> None:
    """Drop every cache computed with the old weights (mandatory after each update)."""
    llm.llm_engine.reset_encoder_cache()
    llm.reset_prefix_cache()


def load_into_engine(llm: Any, weights: Any = None, weights_path: str | None = None) -> float:
    """``reload_weights`` in place from (name, tensor) pairs or a folder; caches reset; seconds taken."""
    if (weights is None) == (weights_path is None):
        raise ValueError("give exactly one of weights or weights_path")
    start = time.perf_counter()
    if weights is not None:
        # An iterator only crosses no process boundary; with workers in other processes
        # (tensor parallel) it must be a picklable list.
        kwargs = {"weights_iterator": weights}
    else:
        kwargs = {"weights_path": os.fspath(weights_path)}
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    reset_vllm_caches(llm)
    return time.perf_counter() - start


def sync_colocated(llm: Any, vlm: Any, in_process: bool = True) -> float:
    """Push the policy into an engine in this process; seconds taken."""
    weights = policy_weights(vlm)
    return load_into_engine(llm, weights if in_process else list(weights))


def write_weights(weights: Any, dirpath: str | os.PathLike) -> Path:
    """Write (name, tensor) pairs as ``dirpath/model.safetensors``, atomically (a reader never sees half)."""
    from safetensors.torch import save_file

    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    tensors = _cpu_tensors(weights)
    fd, tmp = tempfile.mkstemp(dir=dirpath, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    save_file(tensors, tmp, metadata={"format": "pt"})
    target = dirpath / WEIGHTS_FILE
    os.replace(tmp, target)
    return target


def weights_to_bytes(weights: Any) -> bytes:
    """(name, tensor) pairs as one safetensors blob (the server's request-body transfer)."""
    from safetensors.torch import save

    return save(_cpu_tensors(weights), metadata={"format": "pt"})


def _cpu_tensors(weights: Any) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses shared storage (tied embeddings): copy the second view.
        ptr = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return tensors
