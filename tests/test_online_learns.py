"""The default online jobs learn: GRPO, GSPO, RLOO and Online DPO, run as shipped (``python train.py
method=<m>``: the tiny model's cached SFT warm start, 300 optimizer steps), each raise the sampled
accuracy reward by >= 0.2 on CPU; so does GRPO with LoRA and β > 0 (the KL to the adapter-free model).
Full fine-tuning with β > 0 (a frozen reference copy) learns in ``test_grpo_variants_learn.py``
(``luspo_delta_mask_kl``, β = 0.04): that run builds the reference copy and adds its KL to the loss
(bias-corrected there) as β > 0 does for every loss type, so a run of its own here showed nothing new
for its 40 s.

The measured quantity is the mean accuracy reward of 4 completions sampled (temperature 1, fixed
seeds) for each of 64 held-out prompts, before (``validate_before_fit=true``) and after training: the
same prompts and seeds both times (``val/rewards/accuracy_reward``; ``val/reward`` is its weighted sum).
The README's GRPO run also validates every 100 steps, as shipped; the others validate only then, since
validation samples in a forked RNG and leaves the training run as it is.
"""

from __future__ import annotations

import csv
import statistics
import time

import pytest
from test_train import _run

from helpers import compose_train, reward_gains, validate_at_the_end
from lightning_vlm.training import train

QUIET = ["logger=csv", "callbacks=none", "validate_before_fit=true", "trainer.enable_progress_bar=false"]
# variants beyond the defaults: overrides and training batches, sized to pass with margin
VARIANTS = {
    # LoRA adapters (plus the output head, conf/scale/tiny.yaml) with the KL to the adapter-free model
    "grpo_lora_beta": (["method=grpo", "lora=default", "method.beta=0.04"], 300),
}


# The median over these seeds is asked for where one seed is a lottery on some CPUs: Online DPO gave
# 0.383 -> 0.83 (seed 0) where its bar was set, and 0.758 / 0.855 / 0.922 (seeds 0 / 1 / 2) on an AMD EPYC.
# Seed 0 runs last: the third seed only runs when the first two disagree (helpers.reward_gains).
SEEDS = {"online_dpo": (1, 2, 0)}


def _rewards(rows: list[dict]) -> list[float]:
    return [float(r["val/rewards/accuracy_reward"]) for r in rows if r.get("val/rewards/accuracy_reward")]


@pytest.mark.slow
def test_the_readme_grpo_command_raises_val_reward_by_020(tmp_path):
    # The README's command as a user runs it (train.py in a subprocess; CSV to read the curve back).
    start = time.time()
    proc = _run(["method=grpo", *QUIET], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics,) = (tmp_path / "logs" / "grpo" / "runs").glob("*/csv/version_0/metrics.csv")
    rewards = _rewards(list(csv.DictReader(metrics.open())))
    print(f"grpo default: val accuracy reward {rewards} in {time.time() - start:.0f} s")
    assert len(rewards) == 4  # before training, then every 100 of the 300 steps
    assert rewards[-1] - rewards[0] >= 0.2, rewards


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gspo", "rloo", "online_dpo"])
def test_default_online_job_raises_accuracy_reward(method, tmp_path):
    start = time.time()
    # Online DPO pairs the best and worst of 4 candidates (issue 13 measured TRL's two samples at 0.38 -> 0.63; with 16 prompts a step, 0.67)
    bar = 0.4 if method == "online_dpo" else 0.2
    (gains,) = reward_gains([f"method={method}", *QUIET], {"accuracy_reward": bar}, tmp_path,
                            SEEDS.get(method, (0,)), configure=validate_at_the_end).values()  # fmt: skip
    print(f"{method} in {time.time() - start:.0f} s")
    assert statistics.median(gains) >= bar, (method, gains)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_grpo_variant_raises_accuracy_reward(name, tmp_path):
    overrides, batches = VARIANTS[name]
    # optimizer steps are batches here; validate once at the end
    stop = ["trainer.max_steps=-1", f"trainer.limit_train_batches={batches}", "trainer.max_epochs=1",
            f"trainer.val_check_interval={batches}"]  # fmt: skip
    start = time.time()
    metrics, out = train(compose_train([*overrides, *QUIET, *stop], tmp_path))
    before = out["initial_metrics"]["val/rewards/accuracy_reward"]
    after = metrics["val/rewards/accuracy_reward"]
    print(f"{name}: sampled accuracy reward {before:.3f} -> {after:.3f} in {time.time() - start:.0f} s")
    assert after - before >= 0.2, (name, before, after)
