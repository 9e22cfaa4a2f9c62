"""SFT learns the synthetic task: held-out answer accuracy goes from chance to >= 0.9 on CPU."""

from __future__ import annotations

import pytest

from helpers import compose_train
from lightning_vlm.training import train


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_qwen2_5_vl", "tiny_qwen3_vl"])
def test_sft_answer_accuracy_rises_from_chance_to_090(model, tmp_path):
    cfg = compose_train(
        [
            f"model={model}",
            "logger=csv",
            "callbacks=none",
            "validate_before_fit=true",
            "trainer.max_steps=300",
            "trainer.val_check_interval=300",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics, out = train(cfg)
    before = out["initial_metrics"]["val/answer_accuracy"]
    after = metrics["val/answer_accuracy"]
    # Eight colours: chance is 1/8; an untrained model answers ~never correctly.
    assert before <= 0.3, before
    assert after >= 0.9, (before, after)
    assert metrics["train/token_accuracy"] > 0.9
