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


def _hub_adapter_config(
    repo_id: str, cache_dir: str | os.PathLike | None, revision: str | None
) -> Path | None:
    """The ``adapter_config.json`` of a hub repo that holds an adapter and no model (``config.json``), from
    the hub or its cache as transformers finds files (offline: the cache only); None for any other repo."""
    from transformers.utils import cached_file, find_adapter_config_file

    found = find_adapter_config_file(repo_id, cache_dir=cache_dir, revision=revision)
    if found is None:
        return None
    model_config = cached_file(
        repo_id, "config.json", cache_dir=cache_dir, revision=revision,
        _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
    )  # fmt: skip
    return None if model_config is not None else Path(found)


def adapter_base(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, revision: str | None = None
) -> str | None:
    """The base model an adapter folder, or a hub repo holding only an adapter, names
    (``base_model_name_or_path``); None for any other value."""
    from lightning_vlm.models.model_source import is_hub_id

    config: Path | None = Path(name_or_path, ADAPTER_CONFIG)
    if Path(name_or_path).is_dir():
        if not config.is_file() or config.with_name("config.json").is_file():
            return None
    elif is_hub_id(str(name_or_path)):
        config = _hub_adapter_config(str(name_or_path), cache_dir, revision)
        if config is None:
            return None
    else:
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


def adapter_chain(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, revision: str | None = None
) -> tuple[str, list[str]]:
    """(the full model, the adapters to merge into it in order) for ``name_or_path``: no adapters for a full
    model, one for an adapter folder or hub repo, more when an adapter's base is an adapter too.
    ``revision`` is the first one's: the others are named by their adapter configs, without one."""
    full, adapters = str(name_or_path), []
    while (base := adapter_base(full, cache_dir, None if adapters else revision)) is not None:
        if full in adapters:
            raise ValueError(f"{ADAPTER_CONFIG} files name each other as base: {' -> '.join(adapters)}")
        adapters.insert(0, full)
        full = base
    return full, adapters


def merge_adapters(
    model: Any, folders: list[str], cache_dir: str | os.PathLike | None = None, revision: str | None = None
) -> Any:
    """``model`` (the first adapter's base) with the adapters in ``folders`` (folders or hub repos) merged
    in, in order; each later adapter names the one before it as its base (see the module docstring).
    ``revision`` is the last one's, the repo the user named (``adapter_chain``)."""
    from peft import PeftModel

    if not folders:
        return model
    for i, folder in enumerate(folders):
        where = {"cache_dir": cache_dir, "revision": revision if i == len(folders) - 1 else None}
        model = PeftModel.from_pretrained(model, folder, **where).merge_and_unload()
        # The merged model's own adapter records this one as its base (PEFT reads ``name_or_path``): a
        # folder by its absolute path (a relative one would be read against the loading process's
        # folder), a hub repo by its id.
        model.name_or_path = str(Path(folder).resolve()) if Path(folder).is_dir() else folder
    # PEFT loads an adapter for inference and freezes every base weight; as from_pretrained leaves a
    # model, all are trainable again (the caller freezes what its settings say).
    return model.requires_grad_(True)


# The files a processor with an image part loads from (transformers 5's processor_config.json nests the
# image processor's settings; older exports write preprocessor_config.json beside the tokenizer's).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def processor_source(
    name_or_path: str, full_model: str, adapters: list[str], cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
) -> str:  # fmt: skip
    """Where the processor loads from: ``name_or_path``, unless it is an adapter (``adapters`` is not empty)
    holding no processor of its own, as PEFT's ``save_pretrained`` writes one (a hub LoRA repo often adds
    the tokenizer only): then its base model ``full_model``, whose processor the adapter was trained with."""
    from transformers.utils import cached_file

    if not adapters:
        return name_or_path
    for name in PROCESSOR_FILES:
        found = cached_file(
            name_or_path, name, cache_dir=cache_dir, revision=revision,
            _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
        )  # fmt: skip
        if found is not None:
            return name_or_path
    return full_model
