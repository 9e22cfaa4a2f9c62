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


@pytest.mark.parametrize("amp", [True, False])
def test_online_clipping_sees_unscaled_fp16_gradients(amp, tmp_path, sft_warm_start):
    """Under fp16 AMP the scaler multiplies every gradient by its scale. An online method clips before
    its own optimizer step, and that clip must see the true gradients: clipped while still scaled,
    max_grad_norm acted on norm * scale, and the unscaled step came out ``scale`` times too small."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_vlm.training import build

    max_norm, scale = 1e-3, 1024.0  # a bound below any real norm: the clip always acts
    cfg = compose_train(
        ["method=grpo", *SHORT[:-1], f"method.max_grad_norm={max_norm}", "trainer.max_steps=1",
         f"model.model_name_or_path={sft_warm_start()}"],
        tmp_path,
    )  # fmt: skip
    datamodule, module = build(cfg)
    norms: list[float] = []

    class NormAtStep(L.Callback):
        """The gradients the step used: still there after it (the next step zeroes them), and the
        scaler unscales in place. Not a step pre-hook: in fp32 the optimizer runs the closure (and so
        the clip) inside its own step, after its pre-hooks."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if amp else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=plugins, callbacks=[NormAtStep()],
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert len(norms) == 1
    assert norms == pytest.approx([max_norm] * len(norms), rel=1e-3)
