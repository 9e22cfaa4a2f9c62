"""The pretrained models' precision setting (fp32 master weights, bf16-mixed compute) runs every method kind.

The hub configs cannot be downloaded here; the tiny model under the same trainer precision exercises
the same code path (autocast around generation, log-probs and losses; fp32 optimizer updates).
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import compose_train
from lightning_vlm.methods.common import configure_optimizers
from lightning_vlm.training import train

SHORT = ["logger=none", "callbacks=none", "trainer.max_steps=2", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", "trainer.precision=bf16-mixed"]  # fmt: skip


@pytest.mark.parametrize(
    "overrides", [["method=sft", "data.batch_size=4"], ["method=dpo", "data.batch_size=4"], ["method=grpo"]]
)
def test_bf16_mixed_trains_fp32_weights(overrides, tmp_path, caplog, sft_warm_start):
    # from the warm start, so GRPO's sampled rewards differ within a group and give a gradient
    cfg = compose_train([*overrides, *SHORT, f"model.model_name_or_path={sft_warm_start()}"], tmp_path)
    import hydra

    before = {k: v.detach().clone() for k, v in hydra.utils.instantiate(cfg.model).model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.common"):
        metrics, out = train(cfg)
    params = dict(out["module"].vlm.model.named_parameters())
    assert out["trainer"].global_step == 2 and out["trainer"].precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 for p in params.values())
    assert any(not torch.equal(p.detach(), before[n]) for n, p in params.items())
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert "half precision" not in caplog.text


def test_half_precision_weights_with_a_small_lr_warn(tiny_path, caplog):
    from lightning_vlm.models.vlm import VLM

    module = torch.nn.Module()
    module.vlm = VLM(tiny_path("qwen2_5_vl"), dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.common"):
        configure_optimizers(module, lambda params: torch.optim.AdamW(params, lr=1e-6))
    assert "trainable parameters are stored in half precision with lr=1e-06" in caplog.text
    caplog.clear()
    module.vlm.model.float()
    configure_optimizers(module, lambda params: torch.optim.AdamW(params, lr=1e-6))
    assert "half precision" not in caplog.text
