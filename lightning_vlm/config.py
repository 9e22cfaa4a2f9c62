"""Hydra/OmegaConf glue: the resolvers and the dataclass-built config nodes our configs use, registered
once on import.

Config nodes built from dataclasses (Hydra's ConfigStore, group ``schema``) keep a default in one
place: the YAML that includes one (``- /schema/sampling@method.sampling``) gets every field, typed and
overridable from the command line, without repeating them.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


def _tiny_vlm(family: str, start: str = "random") -> str:
    # Imported lazily: composing a config must not build a model; resolving this value does (once
    # per recipe, cached on disk: < 1 s for the random model, ~30 s for the SFT warm start).
    if start == "random":
        from lightning_vlm.models.tiny import tiny_vlm_path

        return str(tiny_vlm_path(family))
    from lightning_vlm.models.warm_start import tiny_sft_path

    # "sft" (the colour task), "sft_grounding", "sft_choice", ...: SFT warm starts, built once
    # (warm_start.WARM_STARTS names them all).
    return str(tiny_sft_path(family, start=start))


def register_resolvers() -> None:
    """Registers `${tiny_vlm:<family>[,random|<warm start>]}` (path of an offline tiny model, or of one of
    its SFT warm starts, ``warm_start.WARM_STARTS``); safe to call twice."""
    if not OmegaConf.has_resolver("tiny_vlm"):
        OmegaConf.register_new_resolver("tiny_vlm", _tiny_vlm, use_cache=True)


def register_schemas() -> None:
    """Stores ``schema/sampling`` (``SamplingOptions``) and ``schema/vllm_engine`` (``EngineOptions``)."""
    from lightning_vlm.generation.base import SamplingOptions
    from lightning_vlm.generation.engine_options import EngineOptions

    store = ConfigStore.instance()
    store.store(group="schema", name="sampling", node=SamplingOptions)
    store.store(group="schema", name="vllm_engine", node=EngineOptions)


register_resolvers()
register_schemas()
