"""Image placeholder tokens vs image tensors: the pre-forward check and per-sample slicing of extras.

"Image features and image tokens do not match" is the error users of every VLM trainer hit
(truncated prompts, extras sliced by the wrong count, token type ids padded on the wrong side).
Everything here is computed from the batch tensors and the model config alone, so it runs before
the forward and names the offending sample instead of failing deep inside the model.

Family layouts of the image extras (one "unit" is what one image contributes):
- Qwen2-VL / Qwen2.5-VL: ``pixel_values`` packs ``prod(image_grid_thw[i])`` rows per image.
- Gemma3, LLaVA: one ``pixel_values`` row per image.
- LLaVA-Next: one row per image, tiles padded to the batch maximum along dim 1; ``image_sizes``.
- Idefics3 / SmolVLM: per *sample*: ``pixel_values[b]`` and ``pixel_attention_mask[b]`` padded
  with all-zero images along dim 1.
"""

from __future__ import annotations

import logging

import torch
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    image_size_to_num_patches,
    unpad_image,
)

logger = logging.getLogger(__name__)

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
PER_SAMPLE_FAMILIES = ("idefics3", "smolvlm")
# Per-token keys that must be padded, concatenated and sliced exactly like input_ids.
TOKEN_KEYS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "mm_token_type_ids",
    "labels",
    "completion_mask",
)
# Image keys with one entry per image (or per packed patch row for Qwen).
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask")
# Our own bookkeeping, never passed to the model.
NUM_IMAGES_KEY = "num_images"


def image_token_id(config) -> int:
    """The placeholder id the model scatters image features into."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has no image_token_id / image_token_index")


def num_images_per_sample(inputs: dict, config) -> list[int]:
    """Images of each sample: the encoder's ``num_images`` if present, else inferred from the tensors."""
    if NUM_IMAGES_KEY in inputs:
        return [int(n) for n in inputs[NUM_IMAGES_KEY].tolist()]
    input_ids = inputs["input_ids"]
    if "pixel_values" not in inputs:
        return [0] * input_ids.shape[0]
    if config.model_type in PER_SAMPLE_FAMILIES:
        return _real_idefics_images(inputs["pixel_values"]).sum(dim=1).tolist()
    # One contiguous run of placeholders per image. Ambiguous only when two images sit side by side
    # with nothing between them (LLaVA "<image><image>"): the encoders pass num_images for that.
    is_image = input_ids == image_token_id(config)
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return starts.sum(dim=1).tolist()


def _real_idefics_images(pixel_values: torch.Tensor) -> torch.Tensor:
    # Idefics3 pads the per-sample image axis with all-zero images; it drops them the same way.
    return pixel_values.flatten(2).ne(0).any(dim=2)


def tokens_per_image(inputs: dict, config) -> list[int]:
    """Placeholder tokens each image needs, in batch order (Idefics3: per sample, summed over images)."""
    kind = config.model_type
    if kind in QWEN_FAMILIES:
        merge = config.vision_config.spatial_merge_size
        return (inputs["image_grid_thw"].prod(dim=-1) // merge**2).tolist()
    if kind == "gemma3":
        return [int(config.mm_tokens_per_image)] * inputs["pixel_values"].shape[0]
    if kind == "llava":
        side = inputs["pixel_values"].shape[-1] // config.vision_config.patch_size
        extra = 0 if config.vision_feature_select_strategy == "default" else 1  # the CLS token
        return [side * side + extra] * inputs["pixel_values"].shape[0]
    if kind == "llava_next":
        return [_llava_next_tokens(size, config) for size in inputs["image_sizes"].tolist()]
    if kind in PER_SAMPLE_FAMILIES:
        vision = config.vision_config
        seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        return (_real_idefics_images(inputs["pixel_values"]).sum(dim=1) * seq_len).tolist()
    raise NotImplementedError(f"no image-token rule for model_type {kind!r}")


def _llava_next_tokens(image_size: list[int], config) -> int:
    # Base tile + unpadded anyres grid with one newline token per row (LLaVA-Next's packing).
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    base = side * side + (0 if config.vision_feature_select_strategy == "default" else 1)
    tiles = image_size_to_num_patches(image_size, config.image_grid_pinpoints, vision.image_size)
    if tiles <= 1:
        return base + 1
    grid_h, grid_w = get_anyres_image_grid_shape(image_size, config.image_grid_pinpoints, vision.image_size)
    unpadded = unpad_image(torch.empty(0, grid_h * side, grid_w * side), image_size)
    height, width = unpadded.shape[1:]
    return base + height * (width + 1)


def check_image_tokens(inputs: dict, config) -> None:
    """Raise ``ValueError`` naming the sample when its placeholder count differs from what its images need."""
    input_ids = inputs["input_ids"]
    counts = (input_ids == image_token_id(config)).sum(dim=1).tolist()
    _check_type_ids(inputs, config)
    if "pixel_values" not in inputs:
        for b, found in enumerate(counts):
            if found:
                raise ValueError(f"sample {b}: {found} image tokens in input_ids but no pixel_values")
        return
    try:
        needed_per_image = tokens_per_image(inputs, config)
    except NotImplementedError as err:
        logger.warning("image-token check skipped: %s", err)
        return
    if config.model_type in PER_SAMPLE_FAMILIES:
        needed = needed_per_image
    else:
        per_sample = num_images_per_sample(inputs, config)
        if sum(per_sample) != len(needed_per_image):
            raise ValueError(
                f"the batch has {len(needed_per_image)} images in its image tensors but its samples "
                f"account for {sum(per_sample)} ({per_sample})"
            )
        offsets = [0, *torch.tensor(per_sample).cumsum(0).tolist()]
        needed = [sum(needed_per_image[offsets[b] : offsets[b + 1]]) for b in range(len(per_sample))]
    for b, (found, need) in enumerate(zip(counts, needed, strict=True)):
        if found != need:
            raise ValueError(
                f"sample {b}: {found} image tokens in input_ids but its images need {need}; "
                "was the sequence truncated through its image, or were image tensors sliced wrongly?"
            )


def _check_type_ids(inputs: dict, config) -> None:
    # Token type ids must mark exactly the image tokens; a padding-side mix-up shifts them silently.
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key not in inputs:
            continue
        marked = inputs[key] == 1
        expected = inputs["input_ids"] == image_token_id(config)
        bad = (marked != expected).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"sample {bad[0]}: {key} does not mark the image tokens of input_ids (padded apart?)"
            )


def split_image_inputs(inputs: dict, config) -> list[dict]:
    """The image extras of each sample as its own dict (the inverse of :func:`merge_image_inputs`)."""
    batch = inputs["input_ids"].shape[0]
    present = [k for k in IMAGE_KEYS if k in inputs]
    if not present:
        return [{} for _ in range(batch)]
    if config.model_type in PER_SAMPLE_FAMILIES:
        real = _real_idefics_images(inputs["pixel_values"]).sum(dim=1).tolist()
        # Drop the batch padding so merging other samples re-pads to their own maximum.
        return [{k: inputs[k][b : b + 1, : max(real[b], 1)] for k in present} for b in range(batch)]
    per_sample = num_images_per_sample(inputs, config)
    image_offsets = [0, *torch.tensor(per_sample).cumsum(0).tolist()]
    if config.model_type in QWEN_FAMILIES:
        rows = inputs["image_grid_thw"].prod(dim=-1)
        row_offsets = [0, *rows.cumsum(0).tolist()]
    out = []
    for b in range(batch):
        lo, hi = image_offsets[b], image_offsets[b + 1]
        sample = {}
        for key in present:
            if key == "pixel_values" and config.model_type in QWEN_FAMILIES:
                sample[key] = inputs[key][row_offsets[lo] : row_offsets[hi]]
            else:
                sample[key] = inputs[key][lo:hi]
        if config.model_type == "llava_next" and hi > lo:
            # Keep only this sample's real tiles; merging pads to the new maximum.
            tiles = max(
                image_size_to_num_patches(s, config.image_grid_pinpoints, config.vision_config.image_size)
                for s in sample["image_sizes"].tolist()
            )
            sample["pixel_values"] = sample["pixel_values"][:, :tiles]
        out.append(sample)
    return out


def merge_image_inputs(samples: list[dict], config) -> dict:
    """Concatenate per-sample image extras into one batch, padding the family's ragged axes."""
    keys = [k for k in IMAGE_KEYS if any(k in s for s in samples)]
    merged: dict = {}
    for key in keys:
        parts = [s[key] for s in samples if key in s and s[key].shape[0] > 0]
        if config.model_type in PER_SAMPLE_FAMILIES:
            parts = [s[key] for s in samples]
            merged[key] = _pad_dim1(parts)
        elif config.model_type == "llava_next" and key == "pixel_values":
            merged[key] = _pad_dim1(parts)
        elif parts:
            merged[key] = torch.cat(parts, dim=0)
    return merged


def _pad_dim1(parts: list[torch.Tensor]) -> torch.Tensor:
    # Zero padding is what the processors use (and what the models recognise as "no image").
    width = max(p.shape[1] for p in parts)
    padded = [torch.cat([p, p.new_zeros(p.shape[0], width - p.shape[1], *p.shape[2:])], dim=1) for p in parts]
    return torch.cat(padded, dim=0)


def repeat_samples(inputs: dict, repeats: int, config) -> dict:
    """Each sample ``repeats`` times in a row (token keys and image extras), e.g. for G generations."""
    batch = inputs["input_ids"].shape[0]
    per_sample = split_image_inputs(inputs, config)
    out = merge_image_inputs([per_sample[b] for b in range(batch) for _ in range(repeats)], config)
    for key in (*TOKEN_KEYS, NUM_IMAGES_KEY):
        if key in inputs:
            out[key] = inputs[key].repeat_interleave(repeats, dim=0)
    if (
        NUM_IMAGES_KEY not in out
        and "pixel_values" in inputs
        and config.model_type not in PER_SAMPLE_FAMILIES
    ):
        counts = torch.tensor(num_images_per_sample(inputs, config))
        out[NUM_IMAGES_KEY] = counts.repeat_interleave(repeats)
    return out
