"""Per-family image-token rules: how many placeholder tokens each image needs, from the batch tensors.

Each rule takes the encoded batch and the HF config and returns one count per image in batch order
(per sample for Idefics3, whose images sit along dim 1 of a sample's row). They are referenced by
the family records in ``families.py``; nothing here dispatches on ``model_type``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    image_size_to_num_patches,
    unpad_image,
)


def image_token_id(config) -> int:
    """The placeholder id the model scatters image features into."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has no image_token_id / image_token_index")


def placeholder_runs(input_ids: torch.Tensor, token_id: int) -> list[list[int]]:
    """Per row, the lengths of the contiguous runs of ``token_id`` (one run per image), in order."""
    out = []
    for row in input_ids == token_id:
        positions = row.nonzero().flatten()
        if positions.numel() == 0:
            out.append([])
            continue
        # A run ends wherever the next placeholder is not the next position.
        ends = (positions.diff() != 1).nonzero().flatten() + 1
        bounds = torch.cat([ends.new_zeros(1), ends, ends.new_tensor([positions.numel()])])
        out.append(bounds.diff().tolist())
    return out


def grid_tokens(inputs: dict, config) -> list[int]:
    """Qwen-VL: ``prod(image_grid_thw)`` patches merged ``spatial_merge_size``² to one token."""
    merge = config.vision_config.spatial_merge_size
    return (inputs["image_grid_thw"].prod(dim=-1) // merge**2).tolist()


def check_one_row_per_image(processor: Any) -> None:
    """Refuse Gemma 3's pan-and-scan: its crops give an image several pixel rows and image blocks, while
    the image-token check and the vision cache count one per image (the batch would be refused later
    with an error that blames sliced tensors)."""
    image_processor = getattr(processor, "image_processor", None)
    if getattr(image_processor, "do_pan_and_scan", False):
        raise ValueError(
            "model.processor_kwargs.do_pan_and_scan=true: Gemma 3's pan-and-scan crops are not supported (each "
            "image must be one pixel row); set it to false and raise the image size instead"
        )


def gemma3_tokens(inputs: dict, config) -> list[int]:
    """Gemma3: a fixed ``mm_tokens_per_image`` per image."""
    return [int(config.mm_tokens_per_image)] * inputs["pixel_values"].shape[0]


def gemma4_tokens(inputs: dict, config) -> list[int]:
    """Gemma 4: the image's real patches (position ids not -1) pooled ``pooling_kernel_size``² to one."""
    real = (inputs["image_position_ids"] != -1).all(dim=-1).sum(dim=-1)
    return (real // config.vision_config.pooling_kernel_size**2).tolist()


# Vision towers whose output has no CLS token before the patches (llava-interleave, LLaVA-OneVision-style).
_NO_CLS_TOWERS = frozenset({"siglip_vision_model", "siglip2_vision_model"})


def _llava_extra_tokens(config) -> int:
    """Tokens per image besides the patches: the tower's CLS token (CLIP has one, SigLIP none), less the
    first output token that the ``default`` strategy drops (transformers slices ``[:, 1:]``)."""
    cls = 0 if config.vision_config.model_type in _NO_CLS_TOWERS else 1
    return cls - (1 if config.vision_feature_select_strategy == "default" else 0)


def llava_tokens(inputs: dict, config) -> list[int]:
    """LLaVA: one token per patch, plus the tower's CLS token unless the ``default`` strategy drops it."""
    side = inputs["pixel_values"].shape[-1] // config.vision_config.patch_size
    return [side * side + _llava_extra_tokens(config)] * inputs["pixel_values"].shape[0]


def llava_next_tokens(inputs: dict, config) -> list[int]:
    """LLaVA-Next: base tile + unpadded anyres grid with one newline token per row."""
    return [_llava_next_image(size, config) for size in inputs["image_sizes"].tolist()]


def _llava_next_image(image_size: list[int], config) -> int:
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    base = side * side + _llava_extra_tokens(config)
    tiles = image_size_to_num_patches(image_size, config.image_grid_pinpoints, vision.image_size)
    if tiles <= 1:
        return base + 1
    grid_h, grid_w = get_anyres_image_grid_shape(image_size, config.image_grid_pinpoints, vision.image_size)
    unpadded = unpad_image(torch.empty(0, grid_h * side, grid_w * side), image_size)
    height, width = unpadded.shape[1:]
    return base + height * (width + 1)


def llava_next_tiles(image_sizes: torch.Tensor, config) -> int:
    """The most tiles any of these LLaVA-Next images has (the padded width of their rows)."""
    size = config.vision_config.image_size
    return max(image_size_to_num_patches(s, config.image_grid_pinpoints, size) for s in image_sizes.tolist())


def internvl_tokens(inputs: dict, config) -> list[int]:
    """InternVL: ``image_seq_length`` tokens per tile. Tiles per image are not in the tensors (the
    processor drops ``num_patches``), so each image's tiles are read off its placeholder run, rounded
    up to whole tiles (a cut run then shows as missing tokens), and their total is checked against
    the ``pixel_values`` rows."""
    seq = int(config.image_seq_length)
    runs = [n for row in placeholder_runs(inputs["input_ids"], image_token_id(config)) for n in row]
    tiles = [-(-n // seq) for n in runs]
    if sum(tiles) != inputs["pixel_values"].shape[0]:
        raise ValueError(
            f"the batch's image tokens make {sum(tiles)} tiles of {seq} tokens but pixel_values holds "
            f"{inputs['pixel_values'].shape[0]}; were image tensors sliced wrongly?"
        )
    return [t * seq for t in tiles]


def idefics_tokens(inputs: dict, config) -> list[int]:
    """Idefics3 / SmolVLM, per sample: its real (non-zero) images times the pixel-shuffled tokens."""
    vision = config.vision_config
    seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    return (real_idefics_images(inputs["pixel_values"]).sum(dim=1) * seq_len).tolist()


def real_idefics_images(pixel_values: torch.Tensor) -> torch.Tensor:
    """[B, N] mask of real images: Idefics3 pads the per-sample image axis with all-zero images."""
    return pixel_values.flatten(2).ne(0).any(dim=2)
