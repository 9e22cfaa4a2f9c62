"""GRPO learns the synthetic grounding task from the grounding SFT warm start (tiny Idefics3, vision tower
frozen): ``python train.py experiment=grpo_grounding`` as shipped (300 steps, the R1-style IoU >= 0.5
reward), and the same trained on ``giou_reward`` (400 steps), each raise the mean IoU of the sampled boxes
for held-out prompts (``val/rewards/iou_reward``, 4 samples for each of 64 prompts, fixed seeds) by >= 0.2;
the GIoU run raises its own reward too. Validation runs before and after only: it samples from a forked
RNG, so the training run is the one the config's comment measured with validation every 100 steps."""

from __future__ import annotations

import time

import pytest

from helpers import compose_train
from lightning_vlm.training import train

QUIET = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false"]
VARIANTS = {
    "iou_threshold": [],
    "giou": ["method.reward_funcs=[iou_reward,giou_reward]", "method.reward_weights=[0.0,1.0]",
             "trainer.max_steps=400"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grpo_raises_mean_iou_by_020_from_the_grounding_warm_start(variant, tmp_path):
    cfg = compose_train(["experiment=grpo_grounding", *VARIANTS[variant], *QUIET], tmp_path)
    cfg.trainer.val_check_interval = cfg.trainer.max_steps
    start = time.time()
    metrics, out = train(cfg)
    before, after = out["initial_metrics"], metrics
    iou = (before["val/rewards/iou_reward"], after["val/rewards/iou_reward"])
    print(f"grounding ({variant}): mean IoU {iou[0]:.3f} -> {iou[1]:.3f} in {time.time() - start:.0f} s")
    assert iou[1] - iou[0] >= 0.2, (variant, iou)
    if variant == "giou":
        giou = (before["val/rewards/giou_reward"], after["val/rewards/giou_reward"])
        assert giou[1] - giou[0] >= 0.1, giou
