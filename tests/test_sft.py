"""SFT module behaviour beyond learning: LoRA trains only what it should; labels cover assistant tokens only."""

from __future__ import annotations

import torch

from helpers import compose_train, trained_by_lora
from lightning_vlm.training import train


def test_sft_with_lora_changes_adapters_only(tmp_path):
    cfg = compose_train(
        ["lora=default", "logger=none", "callbacks=none", "trainer.max_steps=3", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", "data.batch_size=8"],
        tmp_path,
    )  # fmt: skip
    import hydra

    vlm = hydra.utils.instantiate(cfg.model)
    before = {k: v.detach().clone() for k, v in vlm.model.named_parameters()}
    assert any("lora_" in k for k in before)
    _, out = train(cfg)
    after = dict(out["module"].vlm.model.named_parameters())
    # train() builds its own model from the same config and seed: compare like with like.
    for name, value in after.items():
        changed = not torch.equal(value.detach(), before[name])
        assert changed == trained_by_lora(name), name


def test_lora_with_frozen_vision_tower_trains_only_the_language_model(tiny_path):
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(tiny_path("qwen2_5_vl"), lora={"r": 4, "lora_alpha": 8}, freeze_vision_tower=True)
    assert not vlm.vision_tower.training and vlm.language_model.training
    trainable = [n for n, p in vlm.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "visual" not in n for n in trainable)
