"""An HF folder from a model sharded by FSDP: every rank takes part in each unit's gather, rank 0 writes.

transformers' ``save_pretrained`` reads the model's ``state_dict()``, which under FSDP is a collective:
called on rank 0 alone (as an export at the end of fit would), it waits for ranks that have already
left, until the process group's timeout. Here the weights come unit by unit
(``parallel.fsdp.unit_state_chunks``, as the vLLM weight sync gathers them), with LoRA merged beside
the model, and are written under the names ``VLM.save_pretrained`` gives them, so both folders load
the same in transformers and vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_vlm.generation.weight_sync import policy_weights, save_adapter
from lightning_vlm.models.weight_names import clear_model_files, write_safetensors
from lightning_vlm.parallel.fsdp import clean_name, unit_state_chunks


def tied_copies(model: torch.nn.Module) -> set[str]:
    """Names under which a parameter appears after its first one (an LM head tied to the embeddings):
    transformers saves a tied weight once, under its first name."""
    seen: set[int] = set()
    copies = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            copies.add(clean_name(name))
        seen.add(id(param))
    return copies


def write_folder(
    vlm: Any,
    dirpath: str | os.PathLike,
    chunks: Iterable[dict[str, torch.Tensor]],
    merge_lora: bool,
    max_shard_size: int | str | None = None,
) -> None:
    """The folder ``VLM.save_pretrained`` writes, from the model's state in parts (each named as in the
    unwrapped ``vlm.model.state_dict()``), sharded alike."""
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    clear_model_files(dirpath)
    if vlm.is_lora and not merge_lora:
        # The adapter's factors and its fully trained modules (modules_to_save), named as PEFT saves them.
        trained = f".modules_to_save.{vlm.model.active_adapter}."
        lora = {
            k.replace(trained, "."): v.cpu()
            for part in chunks
            for k, v in part.items()
            if ".lora_" in k or trained in k
        }
        save_adapter(vlm.model, dirpath, lora)
    else:
        copies = tied_copies(vlm.model)
        parts = ({k: v for k, v in part.items() if k not in copies} for part in chunks)
        state = {name: t.detach().to("cpu").contiguous() for name, t in policy_weights(vlm, parts)}
        write_safetensors(state, dirpath, max_shard_size)
        vlm.hf_model.config.save_pretrained(dirpath)
        if vlm.hf_model.can_generate() and vlm.hf_model.generation_config is not None:
            vlm.hf_model.generation_config.save_pretrained(dirpath)
    vlm.processor.save_pretrained(dirpath)


def save_sharded(
    vlm: Any,
    root: torch.nn.Module,
    dirpath: str | os.PathLike,
    merge_lora: bool,
    writer: bool,
    max_shard_size: int | str | None = None,
) -> None:
    """Write ``vlm`` (sharded under the FSDP ``root``) to ``dirpath`` as ``VLM.save_pretrained`` does: the
    full model (LoRA merged), or with ``merge_lora=False`` a LoRA model's adapter alone. A collective:
    every rank calls it; only the ``writer`` writes."""
    chunks = unit_state_chunks(root, vlm.model)
    if writer:
        write_folder(vlm, dirpath, chunks, merge_lora, max_shard_size)
    else:
        for _ in chunks:  # take part in each unit's gather
            pass
