"""``model.processor_kwargs`` that the processor takes, or a refusal naming the one it does not.

``AutoProcessor.from_pretrained`` hands every keyword to the tokenizer, which stores any name, so a
setting no part of the processor reads is dropped without a word: ``max_pixels`` (Qwen's) on Gemma 3,
InternVL, Idefics3 or LLaVA-Next leaves images at full size, and the run meets it as an out-of-memory
error on the first large batch (transformers #41955, verl #2942 are cases of it). Known here: the settings
each part (image and video processors, feature extractor) declares (``valid_kwargs``) or has as an
attribute (transformers applies a keyword wherever ``hasattr`` finds it), the processor's own arguments
and per-call settings, the tokenizer's attributes, and loading options (``use_fast``, ``backend``, ...).
A processor that declares no settings (remote code of another shape) is not checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from .model_source import LOCATION_KEYS

# from_pretrained options for how the processor is built or fetched, not settings of a part
LOADING = frozenset({"use_fast", "backend", "token", "local_files_only", "force_download", "proxies"})
# Where the loading options that VLM passes itself are set: given again here, the processor call saw the
# keyword twice (TypeError), or read another revision than the weights.
SET_ELSEWHERE = {"trust_remote_code": "model.trust_remote_code"} | {
    k: f"model.model_kwargs.{k}" for k in LOCATION_KEYS
}
# per-call plumbing, not image settings: left out of the list a refusal prints
_PER_CALL = frozenset({"data_format", "input_data_format", "device", "return_tensors", "disable_grouping"})
# names users bring from other libraries or families, and this family's name for the same thing
_HINTS = {"min_pixels": "Qwen's", "max_pixels": "Qwen's", "max_dynamic_patch": "InternVL's remote code's; "
          "transformers' InternVL calls it max_patches", "num_crops": "Phi-3-Vision's"}  # fmt: skip


def _declared(cls: Any) -> set[str]:
    """The keys of a TypedDict of settings (a part's ``valid_kwargs``), read as transformers reads them: its
    annotations (a TypedDict's hold its bases' too), unresolved, as a remote-code class may name types that
    do not import here."""
    return set(getattr(cls, "__annotations__", {}))


def _parts(processor: Any) -> list[Any]:
    """The processor's parts but the tokenizer (image and video processors, feature extractor)."""
    names = type(processor).get_attributes() if hasattr(type(processor), "get_attributes") else []
    return [
        getattr(processor, n) for n in names if n != "tokenizer" and getattr(processor, n, None) is not None
    ]


def known_settings(processor: Any) -> set[str] | None:
    """The setting names the processor's parts declare, its arguments and per-call settings; None when it
    declares none (it cannot be told)."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None or getattr(type(image_processor), "valid_kwargs", None) is None:
        return None
    names = set(LOADING)
    for part in _parts(processor):
        names |= _declared(getattr(type(part), "valid_kwargs", None))
    names |= set(inspect.signature(type(processor).__init__).parameters) - {"self", "kwargs"}
    groups = getattr(processor, "valid_processor_kwargs", None)
    for group in getattr(groups, "__annotations__", {}).values():  # text_kwargs, images_kwargs, ...
        names |= _declared(group) if isinstance(group, type) else set()
    return names


def check_loading_options(settings: Mapping[str, Any] | None) -> None:
    """Before the processor loads: refuse ``model.processor_kwargs`` that the model's own settings give."""
    elsewhere = [k for k in settings or {} if k in SET_ELSEWHERE]
    if elsewhere:
        raise ValueError(
            f"model.processor_kwargs {elsewhere}: set {', '.join(SET_ELSEWHERE[k] for k in elsewhere)} instead "
            "(the processor is loaded with the model's own, so they come from the same revision and code)"
        )


def check_processor_settings(processor: Any, settings: Mapping[str, Any] | None) -> None:
    """Refuse ``model.processor_kwargs`` keys that no part of ``processor`` reads, naming the image settings
    it does read."""
    if not settings:
        return
    known = known_settings(processor)
    if known is None:
        return
    holders = [*_parts(processor), getattr(processor, "tokenizer", None)]
    unread = [
        k for k in settings if k not in known and not any(hasattr(p, k) for p in holders if p is not None)
    ]
    if unread:
        image_processor = processor.image_processor
        image_settings = sorted(_declared(type(image_processor).valid_kwargs) - _PER_CALL)
        hints = "".join(f" ({k} is {_HINTS[k]})" for k in unread if k in _HINTS)
        raise ValueError(
            f"model.processor_kwargs {unread}: {type(processor).__name__} reads no such setting, and "
            f"transformers drops it without a word, so it would change nothing{hints}. Its image processor, "
            f"{type(image_processor).__name__}, takes: {', '.join(image_settings)}"
        )
