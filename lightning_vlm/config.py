"""Hydra/OmegaConf glue: the resolvers our configs use, registered once on import."""

from __future__ import annotations

from omegaconf import OmegaConf


def _tiny_vlm(family: str) -> str:
    # Imported lazily: composing a config must not build a model; resolving this value does
    # (once per recipe, cached on disk, < 1 s).
    from lightning_vlm.models.tiny import tiny_vlm_path

    return str(tiny_vlm_path(family))


def register_resolvers() -> None:
    """Registers `${tiny_vlm:<family>}` (path of an offline tiny model); safe to call twice."""
    if not OmegaConf.has_resolver("tiny_vlm"):
        OmegaConf.register_new_resolver("tiny_vlm", _tiny_vlm, use_cache=True)


register_resolvers()
