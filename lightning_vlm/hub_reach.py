"""Offline when the Hugging Face Hub cannot be reached, so a missing model or dataset is named at once.

Online, huggingface_hub retries each file a model or dataset needs (5 tries, seconds apart): on a
machine without the network, ``python train.py model=qwen2_5_vl`` spent two and a half minutes on
retries before a connection error that named no setting. Offline (``HF_HUB_OFFLINE=1``) the checks
here say which model or dataset is missing from the cache, and how to get it, before anything loads.
So a run whose settings need the hub tries it once, briefly, and goes offline when it cannot reach it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_vlm.data.sources import located_sources
from lightning_vlm.models.model_source import hub_offline, is_hub_id

log = logging.getLogger(__name__)
# One request: the hub answers in well under a second where it can be reached at all.
PROBE_TIMEOUT_S = 5.0


def _model_names(node: Any) -> list[str]:
    """Every ``model_name_or_path`` inside ``node`` (reward models, a ``TaskReward``'s routes)."""
    if isinstance(node, Mapping):
        own = [str(node["model_name_or_path"])] if node.get("model_name_or_path") is not None else []
        return own + [
            n for key, value in node.items() if key != "model_name_or_path" for n in _model_names(value)
        ]
    if isinstance(node, list | tuple):
        return [n for value in node for n in _model_names(value)]
    return []


def hub_names(cfg: Mapping[str, Any]) -> list[str]:
    """The model and dataset names in a train/eval config that only the hub can resolve: the policy's,
    reward models', and the data's."""
    reward_funcs = OmegaConf.to_container(
        OmegaConf.create({"r": (cfg.get("method") or {}).get("reward_funcs")})
    )
    models = [(cfg.get("model") or {}).get("model_name_or_path"), *_model_names(reward_funcs)]
    names = [
        str(m)
        for m in models
        if m is not None and not Path(str(m)).expanduser().exists() and is_hub_id(str(m))
    ]
    return names + [path for _, path, where in located_sources(cfg.get("data") or {}) if where == "hub"]


def hub_unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub's endpoint cannot be reached now (one request through huggingface_hub's session, so
    its proxy settings apply; no retries), or None when it answers."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as err:  # any transport failure (DNS, refused, timeout, proxy) means unreachable
        return f"{constants.ENDPOINT}: {type(err).__name__}: {err}"
    return None


def go_offline(reason: str) -> None:
    """Offline mode for this process and the processes it starts (Lightning's DDP launcher re-runs the
    script with this environment). huggingface_hub and transformers read the constant at each call;
    datasets keeps its own copy, read when it was imported."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    try:
        from datasets import config
    except ImportError:  # datasets not installed: nothing to switch
        pass
    else:
        config.HF_HUB_OFFLINE = True
    log.warning(
        "The Hugging Face Hub cannot be reached (%s): running offline, as with HF_HUB_OFFLINE=1; only "
        "models and datasets already in the local cache load",
        reason,
    )


def offline_if_unreachable(cfg: Mapping[str, Any]) -> bool:
    """Go offline when ``cfg`` names models or datasets only the hub resolves and the hub cannot be
    reached; True if it did. Nothing is asked of the network otherwise (local folders, synthetic data,
    or offline already)."""
    if hub_offline() or not hub_names(cfg):
        return False
    reason = hub_unreachable()
    if reason is None:
        return False
    go_offline(reason)
    return True
