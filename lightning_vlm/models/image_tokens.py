"""Image placeholder tokens vs image tensors: the pre-forward check and per-sample slicing of extras.

"Image features and image tokens do not match" is the error users of every VLM trainer hit
(truncated prompts, extras sliced by the wrong count, token type ids padded on the wrong side).
Everything here is computed from the batch tensors and the model config alone, so it runs before
the forward and names the offending sample instead of failing deep inside the model.

How a family lays out its image extras (its ``layout``) and counts its tokens comes from the
family registry (``families.py``); this module only applies those rules.
"""

from __future__ import annotations

import torch

from .families import IMAGE_KEYS, family_of
from .family_rules import image_token_id, llava_next_tiles, placeholder_runs, real_idefics_images

# Per-token keys that must be padded, concatenated and sliced exactly like input_ids.
TOKEN_KEYS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "mm_token_type_ids",
    "labels",
    "completion_mask",
)
# Our own bookkeeping, never passed to the model.
NUM_IMAGES_KEY = "num_images"


def num_images_per_sample(inputs: dict, config) -> list[int]:
    """Images of each sample: the encoder's ``num_images`` if present, else inferred from the tensors."""
    if NUM_IMAGES_KEY in inputs:
        return [int(n) for n in inputs[NUM_IMAGES_KEY].tolist()]
    input_ids = inputs["input_ids"]
    if "pixel_values" not in inputs:
        return [0] * input_ids.shape[0]
    if family_of(config).layout == "sample_rows":
        return real_idefics_images(inputs["pixel_values"]).sum(dim=1).tolist()
    # One contiguous run of placeholders per image. Ambiguous only when two images sit side by side
    # with nothing between them (LLaVA "<image><image>"): the encoders pass num_images for that.
    return [len(runs) for runs in placeholder_runs(input_ids, image_token_id(config))]


def tokens_per_image(inputs: dict, config) -> list[int]:
    """Placeholder tokens each image needs, in batch order (Idefics3: per sample, summed over images)."""
    return family_of(config).tokens_per_image(inputs, config)


def rows_per_image(inputs: dict, config) -> list[int]:
    """``pixel_values`` rows of each image, in batch order (not for the ``sample_rows`` layout)."""
    family = family_of(config)
    if family.layout == "patch_rows":
        return inputs["image_grid_thw"].prod(dim=-1).tolist()
    if family.layout == "tile_rows":
        seq = int(config.image_seq_length)
        return [n // seq for n in tokens_per_image(inputs, config)]
    return [1] * len(tokens_per_image(inputs, config))


def features_per_sample(inputs: dict, config) -> list[int]:
    """Entries of ``get_image_features``' output each sample owns: its images, or their tiles
    (InternVL), or its real sub-images (Idefics3 / SmolVLM with image splitting)."""
    layout = family_of(config).layout
    if layout == "sample_rows":
        if "pixel_values" not in inputs:
            return [0] * inputs["input_ids"].shape[0]
        return real_idefics_images(inputs["pixel_values"]).sum(dim=1).tolist()
    per_sample = num_images_per_sample(inputs, config)
    if layout != "tile_rows":
        return per_sample
    tiles = rows_per_image(inputs, config)
    offsets = [0, *torch.tensor(per_sample, dtype=torch.long).cumsum(0).tolist()]
    return [sum(tiles[offsets[b] : offsets[b + 1]]) for b in range(len(per_sample))]


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
    needed_per_image = tokens_per_image(inputs, config)
    if family_of(config).layout == "sample_rows":
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
    layout = family_of(config).layout
    if layout == "sample_rows":
        real = real_idefics_images(inputs["pixel_values"]).sum(dim=1).tolist()
        # Drop the batch padding so merging other samples re-pads to their own maximum; a text-only
        # sample carries nothing (alone, an all-padding image breaks the model).
        return [
            {k: inputs[k][b : b + 1, : real[b]] for k in present} if real[b] else {} for b in range(batch)
        ]
    per_sample = num_images_per_sample(inputs, config)
    image_offsets = [0, *torch.tensor(per_sample).cumsum(0).tolist()]
    row_offsets = [0, *torch.tensor(rows_per_image(inputs, config), dtype=torch.long).cumsum(0).tolist()]
    out = []
    for b in range(batch):
        lo, hi = image_offsets[b], image_offsets[b + 1]
        sample = {}
        if hi == lo:  # a text-only sample carries no image extras (an empty pixel_values breaks models)
            out.append(sample)
            continue
        for key in present:
            # pixel_values is counted in rows (patches, tiles); every other extra in images.
            rows = key == "pixel_values" and layout in ("patch_rows", "tile_rows")
            sample[key] = inputs[key][row_offsets[lo] : row_offsets[hi]] if rows else inputs[key][lo:hi]
        if layout == "padded_tiles":
            # Keep only this sample's real tiles; merging pads to the new maximum.
            sample["pixel_values"] = sample["pixel_values"][
                :, : llava_next_tiles(sample["image_sizes"], config)
            ]
        out.append(sample)
    return out


def merge_image_inputs(samples: list[dict], config) -> dict:
    """Concatenate per-sample image extras into one batch, padding the family's ragged axes."""
    layout = family_of(config).layout
    keys = [k for k in IMAGE_KEYS if any(k in s for s in samples)]
    merged: dict = {}
    for key in keys:
        parts = [s[key] for s in samples if key in s and s[key].shape[0] > 0]
        if layout == "sample_rows":
            # Text-only samples get one all-zero image row, as the processor pads them.
            like = parts[0][:, :1] if parts else None
            if like is not None:
                merged[key] = _pad_dim1([s[key] if key in s else torch.zeros_like(like) for s in samples])
        elif layout == "padded_tiles" and key == "pixel_values":
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
    if NUM_IMAGES_KEY not in out and "pixel_values" in inputs and family_of(config).layout != "sample_rows":
        counts = torch.tensor(num_images_per_sample(inputs, config))
        out[NUM_IMAGES_KEY] = counts.repeat_interleave(repeats)
    return out
