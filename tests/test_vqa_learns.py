"""The answer rewards learn: GRPO on each answer-reward kind of the synthetic task, run as shipped
(``python train.py experiment=grpo_<kind>``: tiny Idefics3 from that kind's SFT warm start, vision tower
frozen), raises the reward's mean over 4 completions sampled for each of 128 held-out prompts (fixed
seeds, the same before and after); ``grpo_mixed`` trains two kinds at once, each scored by its own
reward through ``TaskReward``, and raises both. The rewards' values are checked by hand in
``test_rewards_vision.py``; these runs show each one steers a policy. Validation runs before and after
only (it samples from a forked RNG, so the training run is the one the configs' comments measured every
100 steps)."""

from __future__ import annotations

import time

import pytest

from helpers import compose_train
from lightning_vlm.training import train

QUIET = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false"]
# experiment -> {reward metric: gain asked for}; each about half of what the config's comment measured
RUNS = {
    "grpo_choice": {"multiple_choice_reward": 0.3},
    "grpo_ocr": {"ocr_reward": 0.07},
    "grpo_count": {"count_reward": 0.1},
    "grpo_size": {"numeric_reward": 0.06},
    # two tasks in one run, each row scored by its own task's reward (TaskReward): both must rise
    "grpo_mixed": {"multiple_choice_reward": 0.13, "ocr_reward": 0.05},
}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", list(RUNS))
def test_grpo_raises_the_answer_reward(experiment, tmp_path):
    cfg = compose_train([f"experiment={experiment}", *QUIET], tmp_path)
    cfg.trainer.val_check_interval = cfg.trainer.max_steps
    start = time.time()
    metrics, out = train(cfg)
    changes = {
        metric: (out["initial_metrics"][f"val/rewards/{metric}"], metrics[f"val/rewards/{metric}"])
        for metric in RUNS[experiment]
    }
    print(f"{experiment} in {time.time() - start:.0f} s:",
          ", ".join(f"sampled {m} {a:.3f} -> {b:.3f}" for m, (a, b) in changes.items()))  # fmt: skip
    for metric, gain in RUNS[experiment].items():
        before, after = changes[metric]
        assert after - before >= gain, (experiment, metric, before, after)
