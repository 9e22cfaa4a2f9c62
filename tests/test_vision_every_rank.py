"""A text-only forward still runs the vision tower where other ranks could wait on it
(models/vision_every_rank.py): once, before the decoder, adding exactly 0, with its parameters in the
graph. The two-process runs (FSDP and DDP, text-only rows on one rank) are in test_ddp_equivalence."""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import DynamicCache

from helpers import TowerCounter
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.generation.hf import synced_gpus
from lightning_vlm.methods.preference_batch import encode_pairs
from lightning_vlm.models import vision_every_rank
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import LANGUAGE_ATTRS, VLM


def text_only_pairs(vlm: VLM):
    rows = synthetic_rows("preference", 2, seed=5)
    for row in rows:
        row["images"] = []
        row["prompt"][0]["content"] = [b for b in row["prompt"][0]["content"] if b["type"] == "text"]
    return encode_pairs(vlm, rows)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_text_only_forward_runs_the_tower_once_and_adds_exactly_zero(tiny_path, family, monkeypatch):
    torch.manual_seed(0)
    vlm = VLM(tiny_path(family), freeze_vision_tower=False)
    batch = text_only_pairs(vlm)
    tower = [p for p in vlm.vision_tower.parameters() if p.requires_grad]

    def forward() -> tuple[torch.Tensor, int]:
        vlm.model.zero_grad(set_to_none=True)
        with TowerCounter(vlm.vision_tower) as counter:
            logps, _ = vlm.token_logps(batch.inputs, batch.completion_mask)
        logps.sum().backward()
        return logps.detach(), counter.calls

    # The tower parameters a forward with images trains (LLaVA's last layer is unused: it reads an earlier one)
    vlm.model.zero_grad(set_to_none=True)
    images = encode_pairs(vlm, synthetic_rows("preference", 2, seed=5))
    vlm.token_logps(images.inputs, images.completion_mask)[0].sum().backward()
    used = [p.grad is not None for p in tower]
    assert any(used)
    plain, calls = forward()  # one process: nothing to keep in step with
    assert calls == 0 and all(p.grad is None for p in tower)
    monkeypatch.setattr(vision_every_rank, "needs_vision_pass", lambda *args: True)
    kept, calls = forward()
    assert calls == 1
    assert torch.equal(kept, plain)
    # The same parameters are in the graph (DDP reduces their gradients), each with a gradient of exactly 0.
    assert [p.grad is not None for p in tower] == used
    assert not any(p.grad.any() for p in tower if p.grad is not None)


def test_what_counts_as_images_and_as_a_prefill():
    assert not vision_every_rank.has_visual_input({"input_ids": 1, "pixel_values": None})
    # generate (transformers >= 5) encodes images before its first step; prompts without any leave {}
    assert not vision_every_rank.has_visual_input({"mm_encoder_outputs": {}})
    assert not vision_every_rank.has_visual_input({"mm_encoder_outputs": {"image": None}})
    assert vision_every_rank.has_visual_input({"mm_encoder_outputs": {"image": object()}})
    assert vision_every_rank.has_visual_input({"pixel_values": torch.zeros(1)})
    cache = DynamicCache()
    assert vision_every_rank.is_prefill({}) and vision_every_rank.is_prefill({"past_key_values": cache})
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    assert not vision_every_rank.is_prefill({"past_key_values": cache})


def test_one_process_never_needs_the_pass(tiny_path):
    vlm = VLM(tiny_path("llava"))  # its projector trains though the tower is frozen
    assert vision_every_rank.trains_vision(vlm.backbone, LANGUAGE_ATTRS)
    assert not vision_every_rank.needs_vision_pass(vlm.backbone, LANGUAGE_ATTRS)
    frozen = VLM(tiny_path("qwen2_5_vl"))  # Qwen's merger sits inside the frozen tower
    assert not vision_every_rank.trains_vision(frozen.backbone, LANGUAGE_ATTRS)
    pickle.dumps(frozen)  # the hooks are a small picklable object, not closures over the VLM
    assert not synced_gpus(vlm)  # generate: no rank to keep in step with


def sft_inputs(vlm: VLM, with_images: bool) -> dict:
    rows = synthetic_rows("sft", 2, seed=5)
    if not with_images:
        for row in rows:
            row["images"] = []
            for message in row["messages"]:
                if isinstance(message["content"], list):
                    message["content"] = [b for b in message["content"] if b["type"] != "image"]
    return vlm.encode_sft(rows)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_blank_runs_where_a_rank_with_images_runs_the_tower(tiny_path, family, monkeypatch):
    # ZeRO-3 gathers the text embeddings too: the blank must keep the image forward's order of
    # embedding lookup, vision tower and first decoder layer, on both paths.
    vlm = VLM(tiny_path(family))
    events: list[str] = []
    language = vlm.language_model
    modules = {"embed": vlm.backbone.get_input_embeddings(), "vision": vlm.vision_tower,
               "layer": next(m for m in language.modules() if isinstance(m, torch.nn.ModuleList))[0]}  # fmt: skip
    for name, module in modules.items():
        module.register_forward_pre_hook(lambda *_, name=name: events.append(name))

    def order(run) -> list[str]:
        events.clear()
        with torch.no_grad():
            run()
        return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]

    monkeypatch.setattr(vision_every_rank, "needs_vision_pass", lambda *args: True)
    # SFT/KTO: the backbone gets pixels and looks up the embeddings first
    direct = order(lambda: vlm.hidden_states(sft_inputs(vlm, True)))
    assert order(lambda: vlm.hidden_states(sft_inputs(vlm, False))) == direct
    assert direct.index("vision") < direct.index("layer")
    # DPO/GRPO (and generate): the images are encoded before the backbone
    pairs = encode_pairs(vlm, synthetic_rows("preference", 2, seed=5))
    shared = order(lambda: vlm.hidden_states(pairs.inputs))
    assert order(lambda: vlm.hidden_states(text_only_pairs(vlm).inputs)) == shared
    assert shared.index("vision") < shared.index("embed")
