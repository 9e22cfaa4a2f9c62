"""The global step of fit's last validation: train() validates the final weights once more when it is not
the last step, so the metric a sweeper gets and a model card shows are those of the weights exported."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn


class ValidatedStep(L.Callback):
    """Records ``global_step`` at the end of each validation fit runs (``step``; None: none ran). A
    validation before fit (``validate_before_fit``) and the sanity check score other weights: not counted."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.step = trainer.global_step


def validated_final_step(trainer: L.Trainer) -> bool:
    """Whether fit's last validation scored the weights it ended with (no ``ValidatedStep``: assumed)."""
    found = [c for c in trainer.callbacks if isinstance(c, ValidatedStep)]
    return not found or found[0].step == trainer.global_step
