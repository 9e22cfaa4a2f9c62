"""GRPO with LoRA and beta > 0: adapters (and modules_to_save) move, base weights stay, the KL is logged.

That it learns is in test_online_learns.py (grpo_lora_beta).
"""

from __future__ import annotations

import torch

from helpers import compose_train, trained_by_lora
from lightning_vlm.training import train


def test_grpo_lora_with_kl_trains_adapters_only(tmp_path, sft_warm_start):
    cfg = compose_train(
        ["method=grpo", "lora=default", "method.beta=0.04", f"model.model_name_or_path={sft_warm_start()}",
         "logger=csv", "callbacks=none", "trainer.max_steps=3", "trainer.limit_val_batches=0",
         "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"],
        tmp_path,
    )  # fmt: skip
    import hydra

    before = {k: v.detach().clone() for k, v in hydra.utils.instantiate(cfg.model).model.named_parameters()}
    metrics, out = train(cfg)
    module = out["module"]
    assert module.vlm.is_lora and out["trainer"].global_step == 3
    assert list(cfg.model.lora.modules_to_save) == ["lm_head"]  # the tiny models' LoRA setting
    for name, value in module.vlm.model.named_parameters():
        changed = not torch.equal(value.detach(), before[name])
        assert changed == trained_by_lora(name), name
    assert any(k.startswith("train/kl") for k in metrics), sorted(metrics)
