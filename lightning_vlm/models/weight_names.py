"""Weight names as vLLM expects them, from a transformers model's names.

transformers 5 keeps the vision tower of LLaVA-style models (LLaVA, LLaVA-Next, Gemma3) as the bare
vision transformer (``model.vision_tower.encoder...``), while vLLM builds the full vision model and
wants ``vision_tower.vision_model.encoder...``. transformers' loader strips that extra
``vision_model.`` again, so names in vLLM's form load in both. The same mapping serves saving the
tiny zoo's checkpoints and syncing a trainer's weights into a running vLLM engine. Which families
need it is the registry's ``vllm_vision_model_prefix`` (``families.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from .families import family_of

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


def save_for_hf_and_vllm(model: Any, out_dir: str | os.PathLike) -> None:
    """``save_pretrained`` the model, with weight names that both transformers and vLLM load."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out_dir)
    if not family_of(model.config).vllm_vision_model_prefix:
        return
    path = os.path.join(os.fspath(out_dir), "model.safetensors")
    tensors = load_file(path)
    renamed = dict(hf_to_vllm_names(model.config.model_type, tensors.items()))
    save_file(renamed, path, metadata={"format": "pt"})
