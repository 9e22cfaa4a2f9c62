"""Says, naming the setting, when ``model_name_or_path`` can load nothing, before transformers does.

transformers treats anything that is not an existing folder as a hub id, so a mistyped local path
fails with huggingface_hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'",
and an uncached hub id under ``HF_HUB_OFFLINE=1`` with a connection error: neither names the
setting, nor says which of the two the value was meant to be.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
# model.model_kwargs that say where a hub model is found: the processor and the config come from there too
LOCATION_KEYS = ("cache_dir", "revision")


def hub_location(model_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``cache_dir`` and ``revision`` of ``model.model_kwargs``, for every other hub read of the model."""
    return {k: v for k, v in (model_kwargs or {}).items() if k in LOCATION_KEYS}


def hub_offline() -> bool:
    """Whether huggingface_hub is offline (HF_HUB_OFFLINE), as read at import or set since."""
    from huggingface_hub import constants

    # The constant is read when huggingface_hub is imported; the variable may have been set since.
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES


def is_hub_id(name_or_path: str) -> bool:
    """Whether ``name_or_path`` has the form of a hub repo id (``name`` or ``namespace/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return False
    return True


def check_model_source(
    name_or_path: str,
    setting: str = "model.model_name_or_path",
    hub: bool = True,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
) -> None:
    """Raise ``FileNotFoundError`` naming ``setting`` when ``name_or_path`` is neither an existing folder
    nor (with ``hub``) a hub id that can be fetched: offline, it must be in the hub cache already.

    A value that is not a valid hub id (``/abs/dir``, ``./dir``, ``a/b/c``) can only be a local folder.
    """
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise FileNotFoundError(
            f"{setting}={name_or_path!r} is a file; a model is a folder (config.json, weights and "
            "processor files, e.g. written by save_pretrained) or a hub id"
        )
    if not is_hub_id(str(name_or_path)):
        raise FileNotFoundError(
            f"{setting}={name_or_path!r}: the local folder {str(path.absolute())!r} does not exist (and the "
            "value is no hub id, which has the form 'name' or 'namespace/name')"
        )
    if not hub or not hub_offline():
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    # A model repo has a config.json; an adapter repo (an unmerged export pushed) an adapter_config.json.
    cached = [
        try_to_load_from_cache(str(name_or_path), name, cache_dir=cache_dir, revision=revision)
        for name in ("config.json", "adapter_config.json")
    ]
    if not any(isinstance(c, str) for c in cached):
        raise FileNotFoundError(
            f"{setting}={name_or_path!r} is no local folder, and as a hub id it cannot be fetched offline "
            f"(HF_HUB_OFFLINE=1): it is not in the hub cache ({cache_dir or HF_HUB_CACHE}). Download it "
            f"first (`hf download {name_or_path}`), unset HF_HUB_OFFLINE, or point {setting} at a local folder."
        )


# What VLM itself passes to from_pretrained, from its own settings: in model.model_kwargs they would be a
# second value (a TypeError naming no setting) or, TRL's spelling torch_dtype, dropped with a deprecation
# warning while the model loaded in model.dtype.
SET_BY_MODEL = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "attn_implementation": "model.attn_implementation",
                "trust_remote_code": "model.trust_remote_code"}  # fmt: skip


def check_model_kwargs(model_kwargs: Mapping[str, Any] | None) -> None:
    """Refuse ``model.model_kwargs`` keys that the model's own settings give, naming the setting to use."""
    taken = [k for k in model_kwargs or {} if k in SET_BY_MODEL]
    if taken:
        raise ValueError(
            f"model.model_kwargs {taken}: set {', '.join(f'{SET_BY_MODEL[k]}={model_kwargs[k]!r}' for k in taken)} "
            "instead (the model is loaded with those settings, which would override or clash with these)"
        )
