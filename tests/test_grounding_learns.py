"""GRPO learns the synthetic grounding task: ``python train.py experiment=grpo_grounding`` as shipped
(tiny Idefics3 from its grounding SFT warm start, 500 steps, the R1-style IoU >= 0.5 reward) raises the
mean IoU of the sampled boxes for held-out prompts (``val/rewards/iou_reward``, 4 samples for each of 64
prompts, fixed seeds) by >= 0.2. Validation runs before and after only: it samples from a forked RNG, so
the training run is the one the config's comment measured with validation every 100 steps."""

from __future__ import annotations

import time

import pytest

from helpers import compose_train
from lightning_vlm.training import train


@pytest.mark.slow
def test_grpo_raises_mean_iou_by_020_from_the_grounding_warm_start(tmp_path):
    quiet = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false",
             "trainer.val_check_interval=500"]  # fmt: skip
    start = time.time()
    metrics, out = train(compose_train(["experiment=grpo_grounding", *quiet], tmp_path))
    before = out["initial_metrics"]["val/rewards/iou_reward"]
    after = metrics["val/rewards/iou_reward"]
    print(f"grounding: mean IoU {before:.3f} -> {after:.3f} in {time.time() - start:.0f} s")
    assert after - before >= 0.2, (before, after)
