"""Weight names as vLLM expects them, from a transformers model's names.

transformers 5 keeps the vision tower of LLaVA-style models (LLaVA, LLaVA-Next, Gemma3) as the bare
vision transformer (``model.vision_tower.encoder...``), while vLLM builds the full vision model and
wants ``vision_tower.vision_model.encoder...``. transformers' loader strips that extra
``vision_model.`` again, so names in vLLM's form load in both. The same mapping serves saving the
tiny zoo's checkpoints and syncing a trainer's weights into a running vLLM engine. Which families
need it is the registry's ``vllm_vision_model_prefix`` (``families.py``).
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .families import family_of

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_TOWER = re.compile(r"^((?:model\.)?vision_tower\.)(?!vision_model\.)")
_PEFT_PREFIX = "base_model.model."


def hf_to_vllm_names(
    family_or_model_type: str, state_dict_items: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` with the names vLLM's ``load_weights`` accepts for this model type.

    A PEFT wrapper's ``base_model.model.`` prefix and ``.base_layer`` level are removed (merge the
    adapters first: LoRA factors themselves have no place in vLLM's model and raise).
    """
    prefixed = family_of(family_or_model_type).vllm_vision_model_prefix
    for name, tensor in state_dict_items:
        if name.startswith(_PEFT_PREFIX):
            name = name[len(_PEFT_PREFIX) :]
        name = name.replace(".base_layer.", ".")
        if ".lora_" in name:
            raise ValueError(f"LoRA weight {name!r} cannot be loaded into vLLM; merge the adapters first")
        if prefixed:
            name = _TOWER.sub(r"\1vision_model.", name)
        yield name, tensor


# What an export writes that a later one into the same folder may not overwrite: weights of either kind
# (one file or shards, safetensors or .bin) and their index, and a full model's or an adapter's config.
_MODEL_FILES = (
    "model*.safetensors", WEIGHTS_INDEX, "pytorch_model*.bin", "pytorch_model.bin.index.json",
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "config.json",
    "generation_config.json",
)  # fmt: skip


def clear_model_files(out_dir: str | os.PathLike) -> None:
    """Remove an earlier export's model files from ``out_dir`` before another export writes there. Left
    beside the new files, transformers loads the wrong weights without a word: an old single
    ``model.safetensors`` before new shards, an old adapter on a new full model, a new adapter on an old
    full model (transformers itself removes only old shards, and keeps their index)."""
    out = Path(out_dir)
    for pattern in _MODEL_FILES:
        for path in out.glob(pattern):
            path.unlink()


def save_for_hf_and_vllm(
    model: Any, out_dir: str | os.PathLike, max_shard_size: int | str | None = None
) -> None:
    """``save_pretrained`` the model, with weight names that both transformers and vLLM load; a PEFT
    model writes its adapter alone, as PEFT names it.

    ``max_shard_size``: transformers' (its default when None); a model over it is written in shards
    with an index, each shard renamed in place.
    """
    from peft import PeftModel

    clear_model_files(out_dir)
    if isinstance(model, PeftModel):  # adapter_model.safetensors, never sharded
        model.save_pretrained(out_dir)
    else:
        model.save_pretrained(
            out_dir, **({} if max_shard_size is None else {"max_shard_size": max_shard_size})
        )
        if family_of(model.config).vllm_vision_model_prefix:
            _rename_for_vllm(model, Path(out_dir))
    share_weight_files(out_dir)


def share_weight_files(out_dir: str | os.PathLike) -> None:
    """Give the folder's safetensors files the permissions the umask gives any new file. safetensors 0.8
    writes them owner-only (0600), so a teammate, or a vLLM server running as another user, could read the
    config beside them but not the weights."""
    mask = _umask()
    for path in Path(out_dir).glob("*.safetensors"):
        path.chmod(0o666 & ~mask)


def _umask() -> int:
    """The process's umask, read without setting it where Linux tells it (setting it, even back, would let
    another thread create a file under the wrong one in between)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _rename_for_vllm(model: Any, out: Path) -> None:
    """Rewrite the saved shards (and index) under the weight names vLLM loads (``hf_to_vllm_names``)."""
    from safetensors.torch import load_file, save_file

    index_path = out / WEIGHTS_INDEX
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    weight_map: dict[str, str] = {}
    for name in sorted(set(index["weight_map"].values())) if index else [WEIGHTS_NAME]:
        renamed = dict(hf_to_vllm_names(model.config.model_type, load_file(out / name).items()))
        save_file(renamed, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(renamed, name)
    if index:
        index["weight_map"] = weight_map
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as transformers writes it


def write_safetensors(
    state: dict[str, torch.Tensor], out_dir: str | os.PathLike, max_shard_size: int | str | None = None
) -> None:
    """Write a model's weights as ``save_pretrained`` does: ``model.safetensors``, or shards of at most
    ``max_shard_size`` (transformers' default when None) and their index."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    out = Path(out_dir)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=default_max_shard_size() if max_shard_size is None else max_shard_size,
    )  # fmt: skip
    for filename, names in split.filename_to_tensors.items():
        save_file({k: state[k] for k in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        # transformers counts parameters, not buffers; the weights written here are parameters
        total = sum(t.numel() for t in state.values())
        index = {
            "metadata": {"total_parameters": total, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    share_weight_files(out)


def default_max_shard_size() -> int | str:
    """transformers' ``save_pretrained`` default, read from it so both writers shard alike."""
    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
