"""``last.ckpt`` on a step schedule: what a crashed run resumes from, whatever its validation metric did.

Lightning's ``ModelCheckpoint(monitor=..., save_last=True)`` writes ``last.ckpt`` only when it writes a
top-k checkpoint, i.e. when the monitored metric improves at a validation: a crash loses everything
since then. This callback is a second ``ModelCheckpoint`` beside the best-by-metric one (Lightning's way
of combining schedules): no monitor, no top-k files, only ``last.ckpt``, written every
``every_n_train_steps`` optimizer steps, at the batch where fit is stopped early (``max_time``, early
stopping), once more when fit ends, or when the job is told to stop
(SIGTERM: a preemption, a scheduler's time limit, ``kill``), so a preempted run loses no step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException


def _stopping(trainer: L.Trainer) -> bool:
    # A stop Lightning honours: before min_steps/min_epochs it keeps should_stop set and goes on.
    return trainer.should_stop and trainer.fit_loop._can_stop_early


class LastCheckpoint(ModelCheckpoint):
    """Writes ``<dirpath>/last.ckpt`` every ``every_n_train_steps`` optimizer steps (``0``: only at the end)
    and at the end of fit: the full training state (optimizer, loops, data position), so a run resumes
    from it with ``ckpt_path=<dirpath>/last.ckpt``, also a finished one given a larger ``max_steps``."""

    def __init__(
        self, dirpath: _PATH | None = None, every_n_train_steps: int = 50, verbose: bool = False
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            verbose=verbose,
        )
        # global_step at the previous batch end: the schedule fires when a multiple of N is crossed.
        self._step_before: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Starts the schedule at the (possibly resumed) global step."""
        super().on_train_start(trainer, pl_module)
        self._step_before = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Saves ``last.ckpt`` when this batch's optimizer steps reached or passed a multiple of N, and at
        the last step of a ``max_steps`` run."""
        # Not ModelCheckpoint's own test (global_step % N == 0): an online method's batch runs several
        # optimizer steps (steps_per_generation), which can step over the multiple; and for manual
        # optimization it warns at every save that the weights are the post-step ones (what a resume needs).
        every, step = self._every_n_train_steps, trainer.global_step
        before = step if self._step_before is None else self._step_before
        self._step_before = step
        due = every >= 1 and step // every > before // every
        # The last step of a max_steps run, and a stop asked for in this batch (max_time's Timer; our
        # hook runs after every other callback's, as Lightning orders checkpoint callbacks last), are
        # saved here, not in on_train_end: by then Lightning has marked the epoch finished, and a
        # resume from that state would skip the rest of the epoch.
        last_step = 0 < trainer.max_steps <= step
        if due or last_step or _stopping(trainer):
            self._save_now(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: ``last.ckpt`` follows the step schedule, not epochs."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Saves when this validation stopped fit (early stopping); the rest is the best-by-metric
        checkpoint's business."""
        if _stopping(trainer) and not trainer.sanity_checking:
            self._save_now(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final state of a fit that ended otherwise (max_epochs), unless it was just written."""
        self._save_now(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """On SIGTERM, the state after the last finished batch. Lightning stops at a batch's end when the
        signal came (every rank together), so that state is whole; other exceptions may strike mid-step
        and leave the previous ``last.ckpt`` alone."""
        if isinstance(exception, SIGTERMException):
            self._save_now(trainer)

    def _save_now(self, trainer: L.Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
