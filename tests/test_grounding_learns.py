"""GRPO learns the synthetic grounding task from the grounding SFT warm start (tiny Idefics3, vision tower
frozen), 500 steps each. ``python train.py experiment=grpo_grounding`` as shipped (``giou_reward``) raises
the mean IoU of the sampled boxes for held-out prompts (``val/rewards/iou_reward``, 4 samples for each of
64 prompts, fixed seeds) by >= 0.2, and its own reward by >= 0.1. The R1-style reward (1 for IoU >= 0.5)
raises its own reward by >= 0.2; its mean IoU is not asserted: the config measured it gamed on 2 of 3
seeds (boxes just over IoU 0.5). Validation runs before and after only: it samples from a forked RNG, so
the training run is the one the config's comment measured with validation every 100 steps."""

from __future__ import annotations

import time

import pytest

from helpers import compose_train, validate_at_the_end
from lightning_vlm.training import train

QUIET = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false"]
R1_REWARD = "{_target_:lightning_vlm.rewards.iou_reward,_partial_:true,threshold:0.5}"
# variant -> (overrides, the reward it is trained on, the gain that reward must make)
VARIANTS = {
    "giou": ([], "giou_reward", 0.1),
    "iou_threshold": ([f"method.reward_funcs=[iou_reward,{R1_REWARD}]"], "iou_reward_2", 0.2),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grpo_learns_grounding_from_the_grounding_warm_start(variant, tmp_path):
    overrides, reward, gain = VARIANTS[variant]
    cfg = compose_train(["experiment=grpo_grounding", *overrides, *QUIET], tmp_path)
    assert [f if isinstance(f, str) else f.get("threshold") for f in cfg.method.reward_funcs] == (
        ["iou_reward", "giou_reward"] if variant == "giou" else ["iou_reward", 0.5]
    )
    validate_at_the_end(cfg)
    start = time.time()
    metrics, out = train(cfg)
    before, after = out["initial_metrics"], metrics
    iou = (before["val/rewards/iou_reward"], after["val/rewards/iou_reward"])
    own = (before[f"val/rewards/{reward}"], after[f"val/rewards/{reward}"])
    print(f"grounding ({variant}): mean IoU {iou[0]:.3f} -> {iou[1]:.3f}, {reward} {own[0]:.3f} -> "
          f"{own[1]:.3f} in {time.time() - start:.0f} s")  # fmt: skip
    assert own[1] - own[0] >= gain, (variant, own)
    if variant == "giou":
        assert iou[1] - iou[0] >= 0.2, iou
