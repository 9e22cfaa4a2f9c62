"""A frozen vision tower stays in eval mode through the passes that switch the model to eval and back:
HF generation and the LoRA reference (adapters off). ``model.train(True)`` afterwards woke it, so its
dropout would have perturbed the policy's forward and not the reference's."""

from __future__ import annotations

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.generation.base import SamplingSettings
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.methods.preference_batch import encode_pairs
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.vlm import VLM


def _modes(vlm: VLM) -> tuple[bool, bool]:
    """(the model's mode, the vision tower's mode); and no submodule of the tower trains."""
    tower = vlm.vision_tower
    assert all(m.training == tower.training for m in tower.modules())
    return vlm.model.training, tower.training


def test_generation_and_the_lora_reference_leave_the_frozen_tower_in_eval_mode(tiny_path):
    vlm = VLM(tiny_path("qwen2_5_vl"), lora={"r": 4, "lora_alpha": 8}, freeze_vision_tower=True)
    assert _modes(vlm) == (True, False)
    HFGenerator(vlm).generate(synthetic_rows("prompt", 1), 2, SamplingSettings(max_new_tokens=2))
    assert _modes(vlm) == (True, False)
    batch = encode_pairs(vlm, synthetic_rows("preference", 1))
    ReferenceModel(vlm).token_logps(batch.inputs, batch.completion_mask)
    assert _modes(vlm) == (True, False)
    # and a model in eval mode (validation) stays there
    vlm.model.eval()
    HFGenerator(vlm).generate(synthetic_rows("prompt", 1), 2, SamplingSettings(max_new_tokens=2))
    assert _modes(vlm) == (False, False)
