"""Recipes of the tiny offline VLMs: per family, the config, tokens, chat template and processors.

Plain data, so the zoo can hash a recipe to name its cache folder. Sizes are the smallest that
measured to work in both transformers and vLLM on CPU; vLLM's CPU attention needs head_dim >= 32,
hence 64-wide layers with 2 heads. The 2025-26 families are in ``tiny_recipes_new.py``.
"""

from __future__ import annotations

from lightning_vlm.models.tiny_recipe_parts import (
    QWEN2_VIDEO,
    QWEN_EXTRA,
    QWEN_IDS,
    QWEN_IMAGE,
    QWEN_SPECIAL,
    QWEN_TEXT,
    QWEN_VISION,
    TEXT,
    VIT,
    Recipe,
)
from lightning_vlm.models.tiny_recipes_new import NEW_RECIPES
from lightning_vlm.models.tiny_templates import (
    GEMMA3_TEMPLATE,
    IDEFICS3_TEMPLATE,
    LLAVA_TEMPLATE,
    QWEN_TEMPLATE,
)

# LLaVA: CLIP tower on 56x56 images (4x4 patches of 14 = 16 tokens, CLS dropped) + Qwen2 text.
_CLIP = {**VIT, "image_size": 56, "patch_size": 14, "projection_dim": 64, "model_type": "clip_vision_model"}
_CLIP_IMAGE = {
    "size": {"shortest_edge": 56},
    "crop_size": {"height": 56, "width": 56},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_LLAVA_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "image_token": "<image>"}
_LLAVA_TEXT = {
    **TEXT,
    "model_type": "qwen2",
    "vocab_size": "vocab",
    "eos_token_id": "tok:<|im_end|>",
    "pad_token_id": "tok:<|endoftext|>",
}
_LLAVA_COMMON = {
    "text_config": _LLAVA_TEXT,
    "vision_config": _CLIP,
    "image_token_index": "tok:<image>",
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    # The last layer: vLLM then builds every layer of the tower and loads all saved weights.
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,
    "pad_token_id": "tok:<|endoftext|>",
}
_LLAVA_PROCESSOR = {
    "patch_size": 14,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}

_CLASSIC: dict[str, Recipe] = {
    "qwen2_5_vl": Recipe(
        model_type="qwen2_5_vl",
        config={
            **QWEN_IDS,
            "text_config": QWEN_TEXT,
            "vision_config": {**QWEN_VISION, "window_size": 112, "fullatt_block_indexes": [1]},
            "tie_word_embeddings": False,
        },
        special=QWEN_SPECIAL,
        extra_special=QWEN_EXTRA,
        chat_template=QWEN_TEMPLATE,
        image_processor=("Qwen2VLImageProcessor", QWEN_IMAGE),
        processor=("Qwen2_5_VLProcessor", {}),
        processor_parts=QWEN2_VIDEO,
        expected_image_tokens=16,
    ),
    "qwen2_vl": Recipe(
        model_type="qwen2_vl",
        config={
            **QWEN_IDS,
            "text_config": QWEN_TEXT,
            # Qwen2-VL's vision hidden_size is the merger's output width: the text hidden size.
            "vision_config": {
                "depth": 2,
                "embed_dim": 64,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            "tie_word_embeddings": False,
        },
        special=QWEN_SPECIAL,
        extra_special=QWEN_EXTRA,
        chat_template=QWEN_TEMPLATE,
        image_processor=("Qwen2VLImageProcessor", QWEN_IMAGE),
        processor=("Qwen2VLProcessor", {}),
        processor_parts=QWEN2_VIDEO,
        expected_image_tokens=16,
    ),
    "gemma3": Recipe(
        model_type="gemma3",
        config={
            "text_config": {
                **TEXT,
                "head_dim": 32,
                "vocab_size": "vocab",
                "sliding_window": 512,
                "layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 32,
                "eos_token_id": "tok:<end_of_turn>",
                "pad_token_id": "tok:<pad>",
                "bos_token_id": "tok:<bos>",
            },
            # SigLIP on 56x56 images: 16 patches average-pooled to mm_tokens_per_image = 4.
            "vision_config": {
                **VIT,
                "image_size": 56,
                "patch_size": 14,
                "vision_use_head": False,
                "model_type": "siglip_vision_model",
            },
            "mm_tokens_per_image": 4,
            "boi_token_index": "tok:<start_of_image>",
            "eoi_token_index": "tok:<end_of_image>",
            "image_token_index": "tok:<image_soft_token>",
            "eos_token_id": "tok:<end_of_turn>",
            "pad_token_id": "tok:<pad>",
            "bos_token_id": "tok:<bos>",
            "tie_word_embeddings": True,
        },
        special={
            "eos_token": "<end_of_turn>",
            "pad_token": "<pad>",
            "bos_token": "<bos>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        extra_special=("<start_of_turn>", "<eos>"),
        # vLLM's Gemma3 looks "\n" .. "\n\n\n\n" up in the vocabulary by their text.
        added=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
        chat_template=GEMMA3_TEMPLATE,
        image_processor=(
            "Gemma3ImageProcessor",
            {
                "size": {"height": 56, "width": 56},
                "do_pan_and_scan": False,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            },
        ),
        processor=("Gemma3Processor", {"image_seq_length": 4}),
        expected_image_tokens=4,
    ),
    "llava": Recipe(
        model_type="llava",
        config=_LLAVA_COMMON,
        special=_LLAVA_SPECIAL,
        extra_special=QWEN_EXTRA,
        chat_template=LLAVA_TEMPLATE,
        image_processor=("CLIPImageProcessor", _CLIP_IMAGE),
        processor=("LlavaProcessor", _LLAVA_PROCESSOR),
        expected_image_tokens=16,
    ),
    "llava_next": Recipe(
        model_type="llava_next",
        # One 56x56 grid point: the base view plus one 56x56 tile, both 4x4 patches.
        config={**_LLAVA_COMMON, "image_grid_pinpoints": [[56, 56]]},
        special=_LLAVA_SPECIAL,
        extra_special=QWEN_EXTRA,
        chat_template=LLAVA_TEMPLATE,
        image_processor=("LlavaNextImageProcessor", {**_CLIP_IMAGE, "image_grid_pinpoints": [[56, 56]]}),
        processor=("LlavaNextProcessor", _LLAVA_PROCESSOR),
        # 16 base + 16 tile + 4 row newlines
        expected_image_tokens=36,
    ),
    "idefics3": Recipe(
        model_type="idefics3",
        config={
            "text_config": {
                **TEXT,
                "model_type": "llama",
                "vocab_size": "vocab",
                "eos_token_id": "tok:<end_of_utterance>",
                "pad_token_id": "tok:<|endoftext|>",
                "bos_token_id": None,
            },
            # 56x56 images, 16 patches, pixel-shuffled by 2 -> 4 tokens.
            "vision_config": {**VIT, "image_size": 56, "patch_size": 14},
            "scale_factor": 2,
            "image_token_id": "tok:<image>",
            "pad_token_id": "tok:<|endoftext|>",
            "tie_word_embeddings": False,
        },
        special={"eos_token": "<end_of_utterance>", "pad_token": "<|endoftext|>", "image_token": "<image>"},
        extra_special=("<|im_start|>", "<fake_token_around_image>", "<global-img>"),
        chat_template=IDEFICS3_TEMPLATE,
        image_processor=(
            "Idefics3ImageProcessor",
            {
                "do_image_splitting": False,
                "size": {"longest_edge": 56},
                "max_image_size": {"longest_edge": 56},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            },
        ),
        processor=("Idefics3Processor", {"image_seq_len": 4}),
        expected_image_tokens=4,
    ),
}
RECIPES: dict[str, Recipe] = {**_CLASSIC, **NEW_RECIPES}
