"""The online methods through the real entry point: offline tiny run, and the 3B composition."""

from __future__ import annotations

import pytest
from test_configs import _bind
from test_train import _run

from helpers import compose_train


@pytest.mark.parametrize("method", ["grpo", "gspo", "rloo", "online_dpo"])
def test_real_model_composes_with_one_gpu_settings(method, tmp_path):
    cfg = compose_train([f"method={method}", "model=qwen2_5_vl"], tmp_path)
    assert (
        cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing and cfg.model.freeze_vision_tower
    )
    # manual optimisation: the method clips (max_grad_norm), the trainer must not
    assert cfg.trainer.gradient_clip_val is None and cfg.trainer.accumulate_grad_batches == 1
    assert cfg.data._target_.endswith("PromptDataModule")
    _bind(cfg.model)


@pytest.mark.slow
def test_train_py_method_grpo_runs_offline(tmp_path):
    proc = _run(
        ["method=grpo", "logger=csv", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "data.synthetic.num_val=4", "method.num_generations=4"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = next((tmp_path / "logs" / "grpo" / "runs").iterdir())
    assert (run / "checkpoints" / "last.ckpt").is_file()
