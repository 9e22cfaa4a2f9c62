"""One vision pass per unique image set: sequences that share their images share the vision tower's work.

DPO scores a chosen and a rejected answer after the same prompt and images; GRPO/RLOO score G
completions of one prompt. The naive concatenated forward runs the vision tower once per
*sequence*; here it runs once per *unique image set* and the features are reused.

API (for DPO, online RL, anything that scores several sequences per image set):

- Build the batch exactly as for the naive path, one row per sequence, each with its own image
  extras (e.g. ``repeat_samples(vlm.encode_prompts(...), G)`` then ``vlm.encode_prompt_completion``).
- Say which rows share images: ``inputs = with_image_groups(inputs, groups)`` where ``groups[i]`` is
  any integer id, equal for rows with the same images (e.g. ``torch.arange(B).repeat_interleave(G)``;
  see :func:`repeated_groups`). Rows of one group must carry identical image extras (checked).
- Call the usual ``vlm.token_logps(inputs, mask)`` or ``ReferenceModel.token_logps(inputs, mask)``:
  ``VLM.hidden_states`` sees the ``image_groups`` key and routes through :func:`shared_hidden_states`.
- Several batches with the same images row for row (KTO's matched and mismatched answers): encode them
  once, ``encoded = vlm.encoded_images(inputs)`` (or ``ReferenceModel.encoded_images``), and hand them to
  each batch's forward with ``with_encoded_images(batch_inputs, encoded)``.

How: the image extras of the first row of each group are merged into one small batch,
``get_image_features`` runs once on it (with autograd when the tower trains: gradients of all
rows sharing an image accumulate on its one feature tensor), the per-image features are indexed
back into batch order and handed to the HF model as ``mm_encoder_outputs`` (transformers >= 5.19,
every family of the zoo) instead of ``pixel_values``. Qwen keeps ``image_grid_thw`` and
``mm_token_type_ids`` per row, so its 3-D rope positions are computed as in the naive forward. The
log-probs equal the naive path's (tests/test_vision_cache.py, every tiny family, 1e-5).

Family differences come from the registry: InternVL's features are one row per *tile* (the index
is expanded to tile ranges), Qwen3-VL's deepstack features are indexed level by level, and each
family's encoder-only extras (``image_position_ids``, ``pixel_attention_mask``) are dropped once
the features exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .families import family_of
from .image_tokens import features_per_sample, merge_image_inputs, num_images_per_sample, split_image_inputs

IMAGE_GROUPS_KEY = "image_groups"
# Images a batch's forward takes already encoded (with_encoded_images), so it runs no vision tower.
ENCODED_KEY = "encoded_images"


def repeated_groups(num_sets: int, repeats: int) -> torch.Tensor:
    """Group ids for ``repeat_samples(inputs, repeats)``: [0]*repeats + [1]*repeats + ..."""
    return torch.arange(num_sets).repeat_interleave(repeats)


def with_image_groups(inputs: dict, groups: torch.Tensor | Sequence[int]) -> dict:
    """A copy of ``inputs`` whose rows with equal ``groups`` ids run the vision tower once per step."""
    groups = torch.as_tensor(groups, dtype=torch.long).flatten()
    batch = inputs["input_ids"].shape[0]
    if groups.numel() != batch:
        raise ValueError(f"image_groups has {groups.numel()} entries but the batch has {batch} rows")
    return {**inputs, IMAGE_GROUPS_KEY: groups}


def unique_image_inputs(inputs: dict, groups: torch.Tensor, config) -> tuple[dict, torch.Tensor]:
    """Image extras of one row per group, and for every feature entry of the batch (an image, an
    InternVL tile, an Idefics3 sub-image) the index of its entry in the unique extras' features.

    Raises ``ValueError`` naming the rows when two rows of one group carry different images.
    """
    per_row = split_image_inputs(inputs, config)
    counts = num_images_per_sample(inputs, config)
    row_units = features_per_sample(inputs, config)
    first: dict[int, int] = {}
    for i, g in enumerate(groups.tolist()):
        first.setdefault(g, i)
        rep = first[g]
        if rep != i and not _same_images(per_row[i], per_row[rep], counts[i], counts[rep]):
            raise ValueError(
                f"rows {rep} and {i} share image group {g} but carry different images; "
                "image_groups must only group rows with identical image inputs"
            )
    reps = list(first.values())
    unique = merge_image_inputs([per_row[r] for r in reps], config)
    starts, start = {}, 0
    for g, r in first.items():
        starts[g] = start
        start += row_units[r]
    index = [starts[g] + k for i, g in enumerate(groups.tolist()) for k in range(row_units[i])]
    return unique, torch.tensor(index, dtype=torch.long)


def _same_images(a: dict, b: dict, count_a: int, count_b: int) -> bool:
    if count_a != count_b or a.keys() != b.keys():
        return False
    return all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def image_features(backbone: torch.nn.Module, image_inputs: dict):
    """``get_image_features`` on the given extras, the whole output (pooler_output, deepstack...)."""
    return backbone.get_image_features(**image_inputs, return_dict=True)


def index_features(features, index: torch.Tensor):
    """Per-image (or per-tile) ``features`` picked by ``index``, in the container type the model expects."""
    if isinstance(features, torch.Tensor):
        return features.index_select(0, index.to(features.device))
    picked = [features[j] for j in index.tolist()]
    return tuple(picked) if isinstance(features, tuple) else picked


def _encoder_outputs(output, index: torch.Tensor, deepstack: bool):
    pooled = index_features(output.pooler_output, index)
    if not deepstack:
        return BaseModelOutputWithPooling(pooler_output=pooled)
    # Qwen3-VL adds each deepstack level's per-image features in the decoder's first layers.
    levels = [index_features(level, index) for level in output.deepstack_features]
    return type(output)(pooler_output=pooled, deepstack_features=levels)


def encoded_images(vlm, inputs: dict, model: torch.nn.Module) -> dict:
    """``mm_encoder_outputs`` for the images of ``inputs``: the vision tower of ``model`` runs once per image
    group (``IMAGE_GROUPS_KEY``; without it, once per row), with autograd as enabled. ``{}`` without images.

    Hand the result to batches whose row i holds row i's images (``with_encoded_images``) to share one vision
    pass between several forwards (KTO's two halves); ``shared_hidden_states`` calls it otherwise.
    """
    if "pixel_values" not in inputs or not any(num_images_per_sample(inputs, vlm.config)):
        return {}
    groups = inputs.get(IMAGE_GROUPS_KEY)
    if groups is None:
        groups = torch.arange(inputs["input_ids"].shape[0])
    unique, index = unique_image_inputs(inputs, groups.cpu(), vlm.config)
    features = image_features(model.model, unique)
    return {"image": _encoder_outputs(features, index, family_of(vlm.config).deepstack)}


def with_encoded_images(inputs: dict, encoded: dict) -> dict:
    """A copy of ``inputs`` whose forward takes ``encoded`` (``encoded_images`` of a batch with the same images
    in the same rows) instead of running the vision tower."""
    return {**inputs, ENCODED_KEY: encoded}


def shared_hidden_states(vlm, inputs: dict, model: torch.nn.Module) -> torch.Tensor:
    """Last hidden states [B, L, H] of ``model`` (a ``*ForConditionalGeneration``), one vision pass per group,
    or none when ``inputs`` carry their encoded images (``with_encoded_images``).

    ``vlm`` is the :class:`~lightning_vlm.models.vlm.VLM` (for ``model_inputs`` and the config);
    ``model`` is its HF model or a reference copy. Rows without images (or a text-only batch)
    simply take the plain forward.
    """
    encoded = inputs[ENCODED_KEY] if ENCODED_KEY in inputs else encoded_images(vlm, inputs, model)
    kwargs = vlm.model_inputs(inputs)
    family = family_of(vlm.config)
    # Without images, no features, as generate passes for prompts without images: on several processes the
    # blank vision pass then runs where a rank with images encodes them (models/vision_every_rank.py).
    dropped = family.encoder_only_keys if encoded else family.image_keys
    for key in ("pixel_values", *dropped):
        kwargs.pop(key, None)
    return model.model(**kwargs, mm_encoder_outputs=encoded, use_cache=False).last_hidden_state
