"""One vision pass per unique image set: same log-probs and gradients as the naive forward, fewer tower calls."""

from __future__ import annotations

import pytest
import torch

from helpers import TowerCounter
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.methods.preference_batch import encode_pairs
from lightning_vlm.models.image_tokens import repeat_samples
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vision_cache import (
    IMAGE_GROUPS_KEY,
    repeated_groups,
    unique_image_inputs,
    with_image_groups,
)
from lightning_vlm.models.vlm import VLM


@pytest.fixture(scope="module")
def vlms(tiny_path):
    cache: dict[str, VLM] = {}

    def get(family: str) -> VLM:
        if family not in cache:
            torch.manual_seed(0)
            cache[family] = VLM(tiny_path(family), freeze_vision_tower=False)  # grads reach the tower
        return cache[family]

    return get


def pair_rows() -> list[dict]:
    """Three preference rows, one with a non-square image (Qwen: another grid; LLaVA-Next: other tiles)."""
    rows = synthetic_rows("preference", 3, seed=1)
    rows[1]["images"] = [rows[1]["images"][0].resize((84, 140))]
    return rows


def naive_inputs(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != IMAGE_GROUPS_KEY}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_one_pass_logps_and_grads_equal_the_naive_forward(vlms, family):
    vlm = vlms(family)
    batch = encode_pairs(vlm, pair_rows())
    vlm.model.train()
    grads = []
    for inputs in (batch.inputs, naive_inputs(batch.inputs)):
        vlm.model.zero_grad()
        logps, _ = vlm.token_logps(inputs, batch.completion_mask)
        (logps.sum(dim=1) * torch.linspace(1.0, 2.0, logps.shape[0])).sum().backward()
        grads.append(
            (logps.detach(), [p.grad.clone() for p in vlm.vision_tower.parameters() if p.grad is not None])
        )
    (shared, shared_grads), (naive, naive_grads) = grads
    torch.testing.assert_close(shared, naive, atol=1e-5, rtol=0)
    assert shared_grads and len(shared_grads) == len(naive_grads)
    for a, b in zip(shared_grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    vlm.model.zero_grad()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_vision_tower_runs_once_per_unique_image(vlms, family):
    vlm = vlms(family)
    rows = pair_rows()
    batch = encode_pairs(vlm, rows)
    alone = vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])
    with torch.no_grad():
        with TowerCounter(vlm.vision_tower) as unique:
            vlm.hidden_states(alone)
        with TowerCounter(vlm.vision_tower) as shared:
            vlm.token_logps(batch.inputs, batch.completion_mask)
        with TowerCounter(vlm.vision_tower) as naive:
            vlm.token_logps(naive_inputs(batch.inputs), batch.completion_mask)
    assert unique.calls == 1 and unique.units > 0
    assert (shared.calls, shared.units) == (1, unique.units)
    assert naive.units == 2 * unique.units


def test_groups_of_g_completions_and_the_reference_take_the_shared_path(vlms):
    from lightning_vlm.models.reference import ReferenceModel

    vlm = vlms("qwen2_5_vl")
    rows = synthetic_rows("prompt", 2, seed=4)
    prompts = repeat_samples(
        vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows]), 3, vlm.config
    )
    completions = [[300 + i, vlm.end_of_turn_id] for i in range(6)]
    inputs = vlm.encode_prompt_completion(prompts, completions)
    grouped = with_image_groups(inputs, repeated_groups(2, 3))
    mask = inputs["completion_mask"].bool()
    ref = ReferenceModel(vlm)
    with TowerCounter(ref.copy.model.visual) as counter:
        shared, _ = ref.token_logps(grouped, mask)
    naive, _ = ref.token_logps(inputs, mask)
    torch.testing.assert_close(shared, naive, atol=1e-5, rtol=0)
    assert counter.calls == 1


def test_rows_of_one_group_with_different_images_raise(vlms):
    vlm = vlms("llava")
    batch = encode_pairs(vlm, pair_rows())
    bad = with_image_groups(batch.inputs, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="rows 0 and 2 share image group 0"):
        unique_image_inputs(bad, bad[IMAGE_GROUPS_KEY], vlm.config)
    with pytest.raises(ValueError, match="image_groups has 2 entries"):
        with_image_groups(batch.inputs, [0, 1])


def test_text_only_rows_take_the_plain_forward(vlms):
    vlm = vlms("qwen2_5_vl")
    rows = synthetic_rows("preference", 2, seed=5)
    for row in rows:
        row["images"] = []
        row["prompt"][0]["content"] = [b for b in row["prompt"][0]["content"] if b["type"] == "text"]
    batch = encode_pairs(vlm, rows)
    with torch.no_grad():
        shared, _ = vlm.token_logps(batch.inputs, batch.completion_mask)
        naive, _ = vlm.token_logps(naive_inputs(batch.inputs), batch.completion_mask)
    torch.testing.assert_close(shared, naive, atol=1e-5, rtol=0)
