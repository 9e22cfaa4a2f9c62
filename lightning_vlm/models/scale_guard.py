"""Refuses a pretrained model run with the tiny models' settings.

``model.model_name_or_path=Qwen/Qwen2.5-VL-3B-Instruct`` on its own keeps the default
``model=tiny_qwen2_5_vl`` and with it ``conf/scale/tiny.yaml``: a learning rate 1000x TRL's, 8
completion tokens, fp32 and a trained vision tower. The run would start and quietly do the wrong
thing, so train.py reads the model's config (config.json only, never the weights), counts its
parameters on the meta device and stops with the ``model=<family>`` to use instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .adapter_folder import adapter_chain
from .families import FAMILIES
from .model_source import hub_location

log = logging.getLogger(__name__)

# Above this many parameters the tiny settings are wrong (the tiny zoo is ~0.4 M; the smallest
# pretrained VLMs are ~250 M).
TINY_MAX_PARAMETERS = 20_000_000
# transformers model_type -> the conf/model config of that family's pretrained models (the registry's)
FAMILY_CONFIGS = {f.model_type: f.hub_config for f in FAMILIES.values() if f.hub_config}


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _in_tiny_cache(model_name_or_path: str) -> bool:
    # The tiny zoo and its warm starts are tiny by construction: no config read or meta build at start-up.

    from lightning_vlm.models.tiny import default_cache_dir

    return Path(default_cache_dir()).resolve() in Path(model_name_or_path).resolve().parents


def check_model_scale(
    scale_name: str | None,
    model_name_or_path: str,
    trust_remote_code: bool = False,
    model_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Raises when ``model_name_or_path`` is a large model but the tiny models' settings are selected;
    ``model_kwargs``' ``cache_dir`` and ``revision`` say where its config is, as for the model itself."""
    if scale_name != "tiny":
        return
    # An adapter folder or repo (an export with merge_lora=false) holds no model config: its base's is it,
    # at the revision its adapter config names (none: the default), not the adapter's.
    where = hub_location(model_kwargs)
    model_name_or_path, adapters = adapter_chain(model_name_or_path, **where)
    if adapters:
        where.pop("revision", None)
    if _in_tiny_cache(model_name_or_path):
        return
    from transformers import AutoConfig

    choices = ", ".join(f"model={v}" for v in sorted(set(FAMILY_CONFIGS.values())))
    try:
        config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code, **where)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model.model_name_or_path={model_name_or_path!r} is used with the tiny models' settings "
            f"(conf/scale/tiny.yaml, from the default model=tiny_*), and its config cannot be read to "
            f"check its size ({type(err).__name__}: {str(err).splitlines()[0]}). For a pretrained model "
            f"choose its family's config, e.g. `model=qwen2_5_vl model.model_name_or_path="
            f"{model_name_or_path}` ({choices})."
        ) from err
    n = count_parameters(config)
    if n <= TINY_MAX_PARAMETERS:
        return
    family = FAMILY_CONFIGS.get(config.model_type)
    suggestion = f"model={family}" if family else f"one of {choices} (closest to {config.model_type!r})"
    raise ValueError(
        f"model.model_name_or_path={model_name_or_path!r} has {n / 1e9:.2f} B parameters, but the tiny "
        f"models' settings are selected (conf/scale/tiny.yaml: CPU learning rates, 8 completion tokens, "
        f"fp32, a trained vision tower). Choose the family's config so the settings fit the size: "
        f"`{suggestion} model.model_name_or_path={model_name_or_path}`."
    )
