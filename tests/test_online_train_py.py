"""The online methods through the real entry point: offline tiny run, and the 3B composition."""

from __future__ import annotations

import pytest
from test_configs import _bind
from test_train import _run

from helpers import compose_train
from lightning_vlm.generation.base import SamplingSettings


@pytest.mark.parametrize("method", ["grpo", "gspo", "rloo", "online_dpo"])
def test_real_model_composes_with_one_gpu_settings(method, tmp_path):
    cfg = compose_train([f"method={method}", "model=qwen2_5_vl"], tmp_path)
    assert cfg.model.gradient_checkpointing and cfg.model.freeze_vision_tower
    # fp32 master weights, bf16 compute: a 1e-6 AdamW step survives (it would round away on bf16 weights)
    assert cfg.model.dtype == "float32" and cfg.trainer.precision == "bf16-mixed"
    # TRL's lr and completion length for pretrained models, micro-batches that bound activation memory
    assert cfg.method.optimizer.lr == 1e-6 and cfg.method.max_completion_length == 512
    assert cfg.method.micro_batch_size == 8
    # the sampled length is max_completion_length itself, not a second setting
    assert "max_new_tokens" not in cfg.method.sampling
    assert SamplingSettings.of(cfg.method.sampling, cfg.method.max_completion_length).max_new_tokens == 512
    # manual optimisation: the method clips (max_grad_norm), the trainer must not
    assert cfg.trainer.gradient_clip_val is None and cfg.trainer.accumulate_grad_batches == 1
    assert cfg.data._target_.endswith("PromptDataModule")
    _bind(cfg.model)


@pytest.mark.parametrize("method", ["grpo", "gspo", "rloo", "online_dpo"])
def test_size_dependent_settings_follow_the_model(method, tmp_path):
    tiny = compose_train([f"method={method}"], tmp_path)
    assert (tiny.method.optimizer.lr, tiny.method.max_completion_length) == (5e-4, 8)
    assert tiny.trainer.precision == "32-true" and tiny.model.dtype == "float32"
    # the 7B trains LoRA adapters on bf16 weights: LoRA's larger rate; explicit overrides still win
    big = compose_train([f"method={method}", "model=qwen2_5_vl_7b", "method.micro_batch_size=2"], tmp_path)
    assert big.model.dtype == "bfloat16" and big.model.lora.r == 64 and big.model.lora.modules_to_save is None
    assert big.method.optimizer.lr == 1e-5 and big.method.micro_batch_size == 2


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
    # the progress bar (refreshed every step) shows each step's reward
    assert "train/reward_step=" in proc.stdout + proc.stderr  # Lightning's TQDM bar writes to stdout
