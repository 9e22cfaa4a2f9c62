"""GRPO with LoRA and beta > 0 runs: adapters move, base weights stay, KL to the adapter-free reference is logged."""

from __future__ import annotations

import torch

from helpers import compose_train
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
    for name, value in module.vlm.model.named_parameters():
        changed = not torch.equal(value.detach(), before[name])
        assert changed == ("lora_A" in name or "lora_B" in name), name
    assert any(k.startswith("train/kl") for k in metrics), sorted(metrics)
