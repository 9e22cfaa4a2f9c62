"""GRPO, GSPO, RLOO and Online DPO each raise the sampled accuracy reward by >= 0.2 on CPU.

All start from the same short SFT warm start. The measured quantity is the mean accuracy reward of
4 completions sampled (temperature 1, fixed seeds) for each of 64 held-out prompts, before and after
training: the same prompts and seeds both times (``val/rewards/accuracy_reward``).
"""

from __future__ import annotations

import time

import pytest

from helpers import compose_train
from lightning_vlm.training import train

# method -> (overrides, training batches), sized to pass with margin from the shared warm start in
# about a minute each on two idle cores.
RUNS = {
    "grpo": ([], 300),
    "gspo": ([], 200),
    "rloo": ([], 300),
    # 16 prompts a batch: 256 batches are one epoch of the 4096 synthetic prompts (validation at the end)
    "online_dpo": ([], 250),
    "grpo_beta": (["method=grpo", "method.beta=0.04"], 300),
    # LoRA adapters (plus the output head, conf/scale/tiny.yaml) with the KL to the adapter-free model
    "grpo_lora_beta": (["method=grpo", "lora=default", "method.beta=0.04"], 300),
}


def run_learning(name: str, warm: str, tmp_path) -> tuple[float, float, float]:
    overrides, batches = RUNS[name]
    method = next((o.split("=")[1] for o in overrides if o.startswith("method=")), name)
    cfg = compose_train(
        [
            f"method={method}",
            *[o for o in overrides if not o.startswith("method=")],
            f"model.model_name_or_path={warm}",
            "logger=csv",
            "callbacks=none",
            "validate_before_fit=true",
            # optimizer steps: several per batch for GSPO; stop on batches, validate once at the end
            "trainer.max_steps=-1",
            f"trainer.limit_train_batches={batches}",
            "trainer.max_epochs=1",
            f"trainer.val_check_interval={batches}",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    start = time.time()
    metrics, out = train(cfg)
    before = out["initial_metrics"]["val/rewards/accuracy_reward"]
    after = metrics["val/rewards/accuracy_reward"]
    return before, after, time.time() - start


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_online_method_raises_accuracy_reward(name, sft_warm_start, tmp_path):
    before, after, seconds = run_learning(name, sft_warm_start(), tmp_path)
    print(f"{name}: sampled accuracy reward {before:.3f} -> {after:.3f} in {seconds:.0f} s")
    assert after - before >= 0.2, (name, before, after)
