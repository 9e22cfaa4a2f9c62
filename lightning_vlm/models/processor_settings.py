"""``model.processor_kwargs`` that the processor takes, or a refusal naming the one it does not.

``AutoProcessor.from_pretrained`` hands every keyword to the tokenizer, which stores any name, so a
setting no part of the processor reads is dropped without a word: ``max_pixels`` (Qwen's) on Gemma 3,
InternVL, Idefics3 or LLaVA-Next leaves images at full size, and the run meets it as an out-of-memory
error on the first large batch (transformers #41955, verl #2942 are cases of it). Known here: the image and
video processors' declared settings (``valid_kwargs``) and attributes, the processor's own arguments and
per-call settings, the tokenizer's attributes, and ``from_pretrained``'s loading options.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from typing import Any

# from_pretrained's own options (where and how to load), not settings of a part
LOADING = frozenset(
    {"use_fast", "backend", "revision", "cache_dir", "token", "local_files_only", "subfolder",
     "force_download", "proxies", "trust_remote_code", "code_revision"}
)  # fmt: skip

# per-call plumbing, not image settings: left out of the list a refusal prints
_PER_CALL = frozenset({"data_format", "input_data_format", "device", "return_tensors", "disable_grouping"})


def _declared(cls: Any) -> set[str]:
    """The keys of a TypedDict of settings (a processor part's ``valid_kwargs``), or none."""
    try:
        return set(typing.get_type_hints(cls)) if isinstance(cls, type) else set()
    except (NameError, TypeError):  # a remote-code class whose annotations do not resolve
        return set(getattr(cls, "__annotations__", {}))


def known_settings(processor: Any) -> set[str] | None:
    """Every setting name some part of ``processor`` reads; None when that cannot be told (a processor
    without declared settings, e.g. remote code of another shape)."""
    image_processor = getattr(processor, "image_processor", None)
    declared = getattr(type(image_processor), "valid_kwargs", None)
    if image_processor is None or declared is None:
        return None
    names = set(LOADING) | _declared(declared)
    for part in (image_processor, getattr(processor, "video_processor", None)):
        if part is not None:
            names |= _declared(getattr(type(part), "valid_kwargs", None)) | set(vars(part))
    names |= set(inspect.signature(type(processor).__init__).parameters) - {"self", "kwargs"}
    for group in _declared(getattr(processor, "valid_processor_kwargs", None)):
        names |= _declared(typing.get_type_hints(processor.valid_processor_kwargs).get(group))
    return names


def check_processor_settings(processor: Any, settings: Mapping[str, Any] | None) -> None:
    """Refuse ``model.processor_kwargs`` keys that no part of ``processor`` reads, naming the image settings
    it does read."""
    if not settings:
        return
    known = known_settings(processor)
    if known is None:
        return
    tokenizer = getattr(processor, "tokenizer", None)
    unread = [k for k in settings if k not in known and not (tokenizer is not None and hasattr(tokenizer, k))]
    if unread:
        image_processor = processor.image_processor
        image_settings = sorted(_declared(type(image_processor).valid_kwargs) - _PER_CALL)
        qwen = " (min_pixels and max_pixels are Qwen's)" if {"min_pixels", "max_pixels"} & set(unread) else ""
        raise ValueError(
            f"model.processor_kwargs {unread}: {type(processor).__name__} reads no such setting, and "
            f"transformers drops it without a word, so it would change nothing{qwen}. Its image processor, "
            f"{type(image_processor).__name__}, takes: {', '.join(image_settings)}"
        )
