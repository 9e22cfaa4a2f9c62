"""Shared pieces of the tiny recipes: the :class:`Recipe` record and the stacks families reuse.

A string value ``"tok:<x>"`` in a config is resolved to the id of token ``<x>`` once the tokenizer
is trained; ``"vocab"`` to the vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """Everything that defines one family's tiny model; hashed into its cache folder name."""

    model_type: str
    config: dict[str, Any]
    # Named special tokens: tokenizer attribute name -> token text.
    special: dict[str, str]
    # Extra special tokens without a named attribute (still never split, skipped when decoding).
    extra_special: tuple[str, ...]
    chat_template: str
    image_processor: tuple[str, dict[str, Any]]
    processor: tuple[str, dict[str, Any]]
    # Non-special added tokens (kept whole, decoded as text), e.g. Gemma3's newline runs.
    added: tuple[str, ...] = ()
    expected_image_tokens: int = 0
    # Further processor parts the processor class requires (video processor, audio feature
    # extractor), even though only images are used: argument name -> (transformers class, kwargs).
    processor_parts: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # The tokenizer's pre-tokenizer split regex and NFC normaliser, for families whose transformers
    # tokenizer class rebuilds its own pipeline on load (Qwen3.5): trained the same way, ids match.
    split_regex: str | None = None


# Text stack shared by the families whose language model is Qwen2- or Llama-like.
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
# A 64-wide, 2-layer ViT: 2 heads of 32 (vLLM's CPU attention floor).
VIT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


QWEN_SPECIAL = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
QWEN_EXTRA = ("<|im_start|>",)
QWEN_IDS = {
    "image_token_id": "tok:<|image_pad|>",
    "video_token_id": "tok:<|video_pad|>",
    "vision_start_token_id": "tok:<|vision_start|>",
    "vision_end_token_id": "tok:<|vision_end|>",
}
QWEN_TEXT = {
    **TEXT,
    "vocab_size": "vocab",
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1000000.0},
    "eos_token_id": "tok:<|im_end|>",
    "pad_token_id": "tok:<|endoftext|>",
    "bos_token_id": None,
}
# min_pixels 56*56 and max_pixels 112*112: a 112x112 image is 8x8 patches of 14 -> 16 tokens after
# the 2x2 merge, a 56x56 one 4 tokens.
QWEN_IMAGE = {
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}

# The patch-14, 2x2-merge vision tower of Qwen2.5-VL and GLM-4.1V at tiny sizes (out_hidden_size: the
# text width).
QWEN_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

# The Qwen2-VL/2.5-VL processors require a video processor; images only are used here.
QWEN2_VIDEO = {
    "video_processor": (
        "Qwen2VLVideoProcessor",
        {"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}},
    )
}
