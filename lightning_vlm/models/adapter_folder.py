"""An adapter folder as a model: PEFT's ``adapter_config.json`` and weights, with no ``config.json``.

``ExportHFModel(merge_lora=false)`` writes one. transformers loads such a folder on its own, through its
PEFT integration: the adapter is then injected but frozen and not a PEFT model, so full fine-tuning
would train nothing and ``model.lora`` fails to find its targets. We load the base model the folder
names and merge the adapter into it instead: the folder then trains, evaluates and serves exactly as the
merged export of the same run (``merge_lora=true``), and a new ``model.lora`` adapts the merged model,
whose adapter-disabled reference is the loaded policy, not the base underneath it. Its own adapter,
exported unmerged, names the folder it started from as its base: the chain loads back in order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(name_or_path: str | os.PathLike) -> str | None:
    """The base model an adapter folder names (``base_model_name_or_path``); None for any other value."""
    config = Path(name_or_path, ADAPTER_CONFIG)
    if not config.is_file() or config.with_name("config.json").is_file():
        return None
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as err:
        raise ValueError(f"{config}: not readable as PEFT's adapter config ({err})") from err
    if not base:
        raise ValueError(
            f"{config} names no base_model_name_or_path, so the model its adapter goes on is unknown: "
            "set it there, or load the folder with PEFT yourself and save the merged model"
        )
    return str(base)


def adapter_chain(name_or_path: str | os.PathLike) -> tuple[str, list[str]]:
    """(the full model, the adapter folders to merge into it in order) for ``name_or_path``: no adapters
    for a full model, one for an adapter folder, more when an adapter's base is an adapter folder too."""
    full, adapters = str(name_or_path), []
    while (base := adapter_base(full)) is not None:
        if full in adapters:
            raise ValueError(f"{ADAPTER_CONFIG} files name each other as base: {' -> '.join(adapters)}")
        adapters.insert(0, full)
        full = base
    return full, adapters


def merge_adapters(model: Any, folders: list[str]) -> Any:
    """``model`` (the first adapter's base) with the adapters in ``folders`` merged in, in order; each
    later adapter names the folder before it as its base (see the module docstring)."""
    from peft import PeftModel

    if not folders:
        return model
    for folder in folders:
        model = PeftModel.from_pretrained(model, folder).merge_and_unload()
        # The merged model's own adapter records this folder as its base (PEFT reads ``name_or_path``).
        model.name_or_path = str(Path(folder).resolve())
    # PEFT loads an adapter for inference and freezes every base weight; as from_pretrained leaves a
    # model, all are trainable again (the caller freezes what its settings say).
    return model.requires_grad_(True)
