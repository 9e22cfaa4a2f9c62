"""Optimizer steps the fp16 loss scaler skips, and the learning-rate schedule that must not count them.

Under ``precision=16-mixed`` the gradient scaler skips a step whose gradients overflowed (several at the
start of a run, while it finds its scale). Lightning steps the scheduler after every optimizer step, skipped
or not, so a warm-up or decay ran ahead of the updates actually made; HF's Trainer (TRL) steps it only
after a step that was taken. A skipped step shows as a lower scale after the step than before it (the
scaler backs off on overflow and grows only after a run of good steps). DeepSpeed's engine keeps its own
loss scale and says whether its last step was applied (Lightning steps the scheduler, not the engine,
so the engine's own rule never runs). bf16 and fp32 skip nothing. Schedulers are stepped per optimizer step
(``configure_optimizers``), so the flag always belongs to the step just made.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.plugins import FSDPPrecision, MixedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy


def loss_scale(trainer: L.Trainer) -> float | None:
    """The fp16 gradient scaler's current scale; None where the precision has no scaler."""
    plugin = trainer.precision_plugin
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision | FSDPPrecision) else None
    return None if scaler is None else float(scaler.get_scale())


def was_skipped(trainer: L.Trainer, scale_before: float | None) -> bool:
    """Whether the optimizer step just made was skipped for overflow (its scale, taken before, backed off)."""
    if isinstance(trainer.strategy, DeepSpeedStrategy):  # not run here: DeepSpeed needs CUDA
        return not trainer.strategy.model.was_step_applied()
    if scale_before is None:
        return False
    after = loss_scale(trainer)
    return after is not None and after < scale_before


def step_holding_schedule(trainer: L.Trainer, optimizer, scheduler) -> None:
    """A manually optimised step (the online methods'): the optimizer's, then the scheduler's unless the
    optimizer's was skipped."""
    before = loss_scale(trainer)
    optimizer.step()
    if scheduler is not None and not was_skipped(trainer, before):
        scheduler.step()


class SkippedStepsHoldSchedule(L.LightningModule):
    """For the methods Lightning optimises itself: a step the scaler skips does not advance the scheduler."""

    _last_step_skipped: bool = False

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        before = loss_scale(self.trainer)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._last_step_skipped = was_skipped(self.trainer, before)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if not self._last_step_skipped:
            super().lr_scheduler_step(scheduler, metric)
