"""The answer rewards learn: GRPO on each answer-reward kind of the synthetic task, run as shipped
(``python train.py experiment=grpo_<kind>``: tiny Idefics3 from that kind's SFT warm start, vision tower
frozen), raises the reward's mean over 4 completions sampled for each of 128 held-out prompts (fixed
seeds, the same before and after); ``grpo_mixed`` trains two kinds at once, each scored by its own
reward through ``TaskReward``, and raises both. The rewards' values are checked by hand in
``test_rewards_vision.py``; these runs show each one steers a policy. Validation runs before and after
only (it samples from a forked RNG, so the training run is the one the configs' comments measured every
100 steps)."""

from __future__ import annotations

import statistics
import time

import pytest

from helpers import reward_gains, validate_at_the_end

QUIET = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false"]
# experiment -> {reward metric: gain asked for}; each about half of what the config's comment measured
RUNS = {
    "grpo_choice": {"multiple_choice_reward": 0.3},
    "grpo_ocr": {"ocr_reward": 0.07},
    "grpo_count": {"count_reward": 0.1},
    "grpo_size": {"numeric_reward": 0.05},
    # two tasks in one run, each row scored by its own task's reward (TaskReward): both must rise
    "grpo_mixed": {"multiple_choice_reward": 0.13, "ocr_reward": 0.05},
}
# Runs whose gain is a lottery of the training seed on some CPUs: the median over these seeds is asked
# for. grpo_ocr gained +0.146 on the machine its bar was set on, and +0.046 / +0.086 / +0.088 with seeds
# 0 / 1 / 2 on an AMD EPYC, where the same warm start rounds differently. Seed 0 runs last: the third
# seed only runs when the first two disagree (helpers.reward_gains), and on the EPYC seeds 1 and 2 agree.
# grpo_count gains +0.13 with seed 0 and +0.30 with seed 1 since its shapes stopped touching (smaller by a pixel).
SEEDS = {"grpo_ocr": (1, 2, 0), "grpo_count": (1, 0, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", list(RUNS))
def test_grpo_raises_the_answer_reward(experiment, tmp_path):
    start = time.time()
    gains = reward_gains([f"experiment={experiment}", *QUIET], RUNS[experiment], tmp_path,
                         SEEDS.get(experiment, (0,)), configure=validate_at_the_end)  # fmt: skip
    print(f"{experiment} in {time.time() - start:.0f} s")
    for metric, gain in RUNS[experiment].items():
        assert statistics.median(gains[metric]) >= gain, (experiment, metric, gains[metric])
