"""The G completions of a prompt share its images: one vision-tower pass per prompt image per forward."""

from __future__ import annotations

import pytest
from online_helpers import FixedGenerator, fit_steps, sample_rollouts, sgd, token_reward_fn

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.methods.grpo import GRPO
from lightning_vlm.methods.online_dpo import OnlineDPO
from lightning_vlm.models.vlm import VLM


@pytest.mark.parametrize(
    ("cls", "generations", "extra"), [(GRPO, 4, {"beta": 0.1}), (OnlineDPO, 2, {"num_candidates": 2})]
)
def test_vision_tower_runs_once_per_unique_image_per_forward(tiny_path, cls, generations, extra):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    rows = synthetic_rows("prompt", 3, seed=7)
    rollouts = sample_rollouts(vlm, rows, generations, max_new_tokens=4)
    module = cls(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=generations,
                 max_completion_length=4, **extra)  # fmt: skip
    module.generator = FixedGenerator(rollouts)
    images_per_call: list[int] = []

    def count(tower, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        images_per_call.append(int(grid.shape[0]))

    # The reference copy (beta > 0, Online DPO) has its own tower: count both.
    towers = [vlm.vision_tower]
    if module.ref is not None and module.ref.copy is not None:
        towers.append(module.ref.copy.model.visual)
    handles = [t.register_forward_pre_hook(count, with_kwargs=True) for t in towers]
    try:
        fit_steps(module, rows)
    finally:
        for h in handles:
            h.remove()
    # The reference forward and the training forward: each sees the 3 prompt images once,
    # not 3 x G completion copies (pixel inputs are always in the forward, Online DPO included).
    assert images_per_call == [3, 3], images_per_call
