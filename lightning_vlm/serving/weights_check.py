"""Checking a weight update against the served checkpoint before vLLM loads it.

vLLM's in-place ``reload_weights`` fails inside the engine on a folder without weights, on unknown
names or on wrong shapes, and a failure there kills the engine core: every later request fails. The
update is therefore read first (safetensors headers only: no tensor data) and refused with a message
naming the first offending tensors, and the engine keeps serving the weights it has.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_vlm.models.families import FAMILIES
from lightning_vlm.models.weight_names import hf_to_vllm_names

Shapes = dict[str, tuple[int, ...]]


class UpdateRefused(ValueError):
    """A weight update that would break the engine; answered with HTTP 400 and this message."""


def read_shapes(folder: str | os.PathLike) -> Shapes:
    """Tensor name -> shape over every ``*.safetensors`` file of ``folder`` (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UpdateRefused(f"no *.safetensors file in {os.fspath(folder)!r}")
    shapes: Shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as exc:  # truncated or not safetensors at all
            raise UpdateRefused(f"{file.name} is not a readable safetensors file: {exc}") from exc
    if not shapes:
        raise UpdateRefused(f"{os.fspath(folder)!r} holds no tensors")
    return shapes


def reference_shapes(model_dir: str | os.PathLike) -> Shapes:
    """The served checkpoint's tensors under every name an update may use for them.

    Updates come in the checkpoint's names or in vLLM's (``hf_to_vllm_names``, e.g. LLaVA's
    ``vision_tower.vision_model.``); a tied ``lm_head.weight`` may be sent though not stored.
    """
    shapes = read_shapes(model_dir)
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    model_type = config.get("model_type", "")
    names = dict(shapes)
    if model_type in FAMILIES:  # vLLM's names where the family renames; any other model serves as saved
        names.update(hf_to_vllm_names(model_type, shapes.items()))
    embed = next((s for n, s in shapes.items() if n.endswith("embed_tokens.weight")), None)
    if embed is not None and "lm_head.weight" not in names:
        names["lm_head.weight"] = embed
    return names


def check_update(update: Shapes, reference: Shapes, limit: int = 5) -> None:
    """Refuse an update with names the checkpoint lacks or shapes that differ from it."""
    unknown = sorted(set(update) - set(reference))
    if unknown:
        raise UpdateRefused(
            f"{len(unknown)} tensor(s) the served model does not have, e.g. {unknown[:limit]}"
        )
    wrong = [f"{n}: {list(s)} (served: {list(reference[n])})" for n, s in update.items() if s != reference[n]]
    if wrong:
        raise UpdateRefused(f"{len(wrong)} tensor(s) with the wrong shape, e.g. {wrong[:limit]}")
