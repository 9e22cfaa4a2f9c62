"""The model-family registry: one record per ``model_type`` holding everything family-specific.

Every family branch in the library reads this table (image tokens and slicing, position ids, the
vision cache, vLLM weight names, suppressed tokens, FSDP layers, the vLLM CPU dtype), so adding a
family is one :class:`Family` record here, one tiny recipe (``tiny_recipes.py``) and one model YAML
(``conf/model/``); README "Add a model family" walks through it. A model type without a record is
a hard error (:func:`family_of`), never a silent guess.

Layouts (one "unit" is one row of ``pixel_values``; see ``image_tokens.py``):

- ``patch_rows``: all images' patches flattened; image ``i`` owns ``prod(image_grid_thw[i])`` rows
  (Qwen2-VL .. Qwen3.5). Features come back one entry per image.
- ``image_rows``: one row per image (Gemma3, Gemma 4, LLaVA).
- ``padded_tiles``: one row per image, its tiles padded to the batch maximum along dim 1
  (LLaVA-Next).
- ``tile_rows``: one row per tile, an image owns several consecutive rows; the vision tower
  returns one feature row per tile (InternVL).
- ``sample_rows``: one row per *sample*, its images along dim 1, zero images as padding (Idefics3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from . import family_rules as rules

Layout = Literal["patch_rows", "image_rows", "padded_tiles", "tile_rows", "sample_rows"]

ADD_FAMILY_HINT = (
    "add a Family record to lightning_vlm/models/families.py (README: 'Add a model family') "
    "or pick one of: {known}"
)


@dataclass(frozen=True)
class Family:
    """Everything the library needs to know about one model family, in one place."""

    model_type: str
    layout: Layout
    # Image tokens each image needs, in batch order (sample_rows: per sample), from the tensors.
    tokens_per_image: Callable[[dict, object], list[int]]
    # Image extras besides pixel_values, sliced and merged like it (per image, or per sample).
    image_keys: tuple[str, ...] = ()
    # Of those, the ones only the vision encoder reads (dropped once its features are computed);
    # the others (image_grid_thw, image_sizes) also steer the language model's inputs.
    encoder_only_keys: tuple[str, ...] = ()
    # M-RoPE: the model derives its 3-D positions from attention_mask (+ mm_token_type_ids) itself;
    # otherwise we pass 1-D positions over real tokens so left padding equals no padding.
    model_positions: bool = False
    # The vision tower also returns per-layer deepstack features (Qwen3-VL) the decoder adds in.
    deepstack: bool = False
    # transformers keeps the bare vision transformer; vLLM wants a ``vision_model.`` level.
    vllm_vision_model_prefix: bool = False
    # Processor/tokenizer attributes and config keys naming special tokens never to sample,
    # beyond the common image/video/vision ones (vlm.py).
    suppress_token_attrs: tuple[str, ...] = ()
    suppress_config_keys: tuple[str, ...] = ()
    suppress_token_pattern: str | None = None
    # The conf/model config of the family's pretrained checkpoints (None: none shipped yet).
    hub_config: str | None = None
    # Class names of the blocks FSDP wraps and checkpoints (decoder layer, vision block).
    layer_classes: tuple[str, ...] = ()
    # transformers' own ``input_modalities`` when the class declares too few: generate() encodes
    # images once before the prefill only for models declaring "image" (Qwen3.5 declares "text").
    input_modalities: tuple[str, ...] | None = None
    # vLLM on CPU has no float32 kernel for some layers (Qwen3.5's Gated DeltaNet): the dtype it needs.
    vllm_cpu_dtype: str = "float32"
    # The model's forward soft-caps its logits by the text config's final_logit_softcapping (Gemma 4's
    # does; Gemma 3's image-text class does not, though its config has the key): log-probs must too.
    final_logit_softcap: bool = False


def _qwen(model_type: str, decoder: str, vision: str, **extra) -> Family:
    return Family(
        model_type=model_type,
        hub_config=model_type,
        layout="patch_rows",
        tokens_per_image=rules.grid_tokens,
        image_keys=("image_grid_thw",),
        model_positions=True,
        layer_classes=(decoder, vision),
        **extra,
    )


def _idefics(model_type: str, decoder: str, vision: str) -> Family:
    return Family(
        model_type=model_type,
        hub_config="smolvlm",
        layout="sample_rows",
        tokens_per_image=rules.idefics_tokens,
        image_keys=("pixel_attention_mask",),
        encoder_only_keys=("pixel_attention_mask",),
        suppress_token_pattern=r"<row_\d+_col_\d+>",
        layer_classes=(decoder, vision),
    )


_LLAVA_LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer", "CLIPEncoderLayer", "SiglipEncoderLayer")

_RECORDS = (
    _qwen("qwen2_vl", "Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"),
    _qwen("qwen2_5_vl", "Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"),
    _qwen("qwen3_vl", "Qwen3VLTextDecoderLayer", "Qwen3VLVisionBlock", deepstack=True),
    _qwen(
        "qwen3_5",
        "Qwen3_5DecoderLayer",
        "Qwen3_5VisionBlock",
        vllm_cpu_dtype="bfloat16",
        input_modalities=("image", "video", "text"),
    ),
    # GLM-4.1V: Qwen2-VL's patch layout and M-RoPE; its template closes no turn (see ``end_of_turn``).
    _qwen("glm4v", "Glm4vTextDecoderLayer", "Glm4vVisionBlock"),
    Family(
        model_type="gemma3",
        hub_config="gemma3",
        layout="image_rows",
        tokens_per_image=rules.gemma3_tokens,
        vllm_vision_model_prefix=True,
        layer_classes=("Gemma3DecoderLayer", "SiglipEncoderLayer"),
    ),
    Family(
        model_type="gemma4",
        hub_config="gemma4",
        layout="image_rows",
        tokens_per_image=rules.gemma4_tokens,
        image_keys=("image_position_ids",),
        encoder_only_keys=("image_position_ids",),
        # Gemma 4's processor names audio markers even for image-only checkpoints.
        suppress_token_attrs=("audio_token", "boa_token", "eoa_token"),
        suppress_config_keys=("audio_token_id", "boa_token_id", "eoa_token_index", "eoa_token_id"),
        layer_classes=("Gemma4TextDecoderLayer", "Gemma4VisionEncoderLayer"),
        final_logit_softcap=True,
    ),
    Family(
        model_type="llava",
        layout="image_rows",
        tokens_per_image=rules.llava_tokens,
        vllm_vision_model_prefix=True,
        layer_classes=_LLAVA_LAYERS,
    ),
    Family(
        model_type="llava_next",
        hub_config="llava_next",
        layout="padded_tiles",
        tokens_per_image=rules.llava_next_tokens,
        image_keys=("image_sizes",),
        vllm_vision_model_prefix=True,
        layer_classes=_LLAVA_LAYERS,
    ),
    Family(
        model_type="internvl",
        hub_config="internvl",
        layout="tile_rows",
        tokens_per_image=rules.internvl_tokens,
        suppress_token_attrs=("start_image_token", "end_image_token", "context_image_token"),
        layer_classes=("Qwen2DecoderLayer", "LlamaDecoderLayer", "InternVLVisionLayer"),
    ),
    _idefics("idefics3", "LlamaDecoderLayer", "Idefics3EncoderLayer"),
    _idefics("smolvlm", "LlamaDecoderLayer", "SmolVLMEncoderLayer"),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in _RECORDS}
# Every image extra any family slices like pixel_values (the union, for code that handles batches).
IMAGE_KEYS: tuple[str, ...] = (
    "pixel_values",
    *dict.fromkeys(k for f in _RECORDS for k in f.image_keys),
)


def family_of(config_or_model_type) -> Family:
    """The registry record of a model config (or a ``model_type``); unknown families are refused."""
    model_type = getattr(config_or_model_type, "model_type", config_or_model_type)
    try:
        return FAMILIES[model_type]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"model_type {model_type!r} is not a supported VLM family: " + ADD_FAMILY_HINT.format(known=known)
        ) from None
