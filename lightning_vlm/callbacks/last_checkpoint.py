"""``last.ckpt`` on a step schedule: what a crashed run resumes from, whatever its validation metric did.

Lightning's ``ModelCheckpoint(monitor=..., save_last=True)`` writes ``last.ckpt`` only when it writes a
top-k checkpoint, i.e. when the monitored metric improves at a validation: a crash loses everything
since then. This callback is a second ``ModelCheckpoint`` beside the best-by-metric one (Lightning's way
of combining schedules): no monitor, no top-k files, only ``last.ckpt``, written every
``every_n_train_steps`` optimizer steps, at the batch where fit is stopped early (``max_time``, early
stopping), once more when fit ends, or when the job is told to stop
(SIGTERM: a preemption, a scheduler's time limit, ``kill``), so a preempted run loses no step. A save
due at a batch that a validation follows waits for that validation's end: Lightning reads a checkpoint
written at a batch end as past that batch's validation, so a crash during the validation lost it.

A stop asked for in the middle of a gradient accumulation (``trainer.accumulate_grad_batches``) waits
for that accumulation's optimizer step. Lightning would stop at once and drop the accumulated
gradients, while the saved loop state counts their batches as done: the resume would never train on
those rows. SIGTERM cannot wait (a scheduler's grace period is short), so it saves mid-accumulation,
and the resumed run's first optimizer step then holds only the window's remaining batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def _stopping(trainer: L.Trainer) -> bool:
    # A stop Lightning honours: before min_steps/min_epochs it keeps should_stop set and goes on.
    return trainer.should_stop and trainer.fit_loop._can_stop_early


def _accumulating(trainer: L.Trainer) -> bool:
    # Lightning's own test, for the batch just run: its gradients wait for a later batch's optimizer step.
    return trainer.fit_loop.epoch_loop._should_accumulate()


def _validates_next(trainer: L.Trainer) -> bool:
    # Lightning's own test, run again after this hook for the batch just run: a validation follows it.
    # Without validation rows (a DataModule's val_dataset None) its loop returns before any hook.
    loop = trainer.fit_loop
    if getattr(trainer.datamodule, "val_dataset", True) is None:
        return False
    return loop._data_fetcher is not None and loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


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
            # Always last.ckpt, what `ckpt_path=last` resumes: Lightning keys a ModelCheckpoint's state by
            # its settings, so a run resumed with another schedule would write last-v1.ckpt beside it.
            enable_version_counter=False,
        )
        # global_step at the previous batch end: the schedule fires when a multiple of N is crossed.
        self._step_before: int | None = None
        self._stop_held = False  # a stop asked for mid-accumulation, held until its optimizer step
        self._after_validation = False  # a scheduled save waiting for the validation of its batch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Starts the schedule at the (possibly resumed) global step; warns when a run that resumes nothing
        finds an earlier run's ``last.ckpt``, which it replaces (here: ``ckpt_path`` is set by now)."""
        super().on_train_start(trainer, pl_module)
        self._step_before = trainer.global_step
        last = Path(self.dirpath or "") / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        if trainer.ckpt_path is None and self.dirpath and last.exists():  # a file, or a sharded (FSDP) folder
            rank_zero_warn(
                f"{last} holds an earlier run's state, which this run (resuming nothing) replaces at its first "
                "save: resume it with ckpt_path=last, or give this run another hydra.run.dir"
            )

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
        # A save left for the previous batch's validation, which did not run (no validation batches):
        # written now, one batch late rather than never.
        due = every >= 1 and step // every > before // every or self._after_validation
        self._after_validation = False
        # The last step of a max_steps run, and a stop asked for in this batch (max_time's Timer; our
        # hook runs after every other callback's, as Lightning orders checkpoint callbacks last), are
        # saved here, not in on_train_end: by then Lightning has marked the epoch finished, and a
        # resume from that state would skip the rest of the epoch.
        last_step = 0 < trainer.max_steps <= step
        if self._hold_stop(trainer):
            return
        if (due or last_step) and not _stopping(trainer) and _validates_next(trainer):
            # Written here, before the validation that follows this batch, Lightning would read it as
            # "validation done" and skip that validation on resume: a crash during it lost it (and the
            # best checkpoint of that step), and a finished run resumed with a larger max_steps its last
            # step's point of the curves. Written once it ran instead (on_validation_end; at the last step
            # on_train_end writes it if none ran). SIGTERM during it still saves at once (on_exception): no
            # step lost, that validation skipped.
            self._after_validation = True
            return
        if due or last_step or _stopping(trainer):
            self._save_now(trainer)

    def _hold_stop(self, trainer: L.Trainer) -> bool:
        """Holds a stop asked for mid-accumulation (True), and asks for it again at the step that ends the
        accumulation. Every rank decides alike: the stop is synced and accumulation counts batches."""
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return False
        if _stopping(trainer) and _accumulating(trainer):
            trainer.should_stop, self._stop_held = False, True
            return True
        if self._stop_held and not _accumulating(trainer):
            trainer.should_stop, self._stop_held = True, False
        return False

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: ``last.ckpt`` follows the step schedule, not epochs."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Saves when this validation stopped fit (early stopping); the rest is the best-by-metric
        checkpoint's business."""
        if trainer.sanity_checking or self._hold_stop(trainer):  # sanity check: Lightning ignores its stops
            return
        if _stopping(trainer) or self._after_validation:
            self._after_validation = False
            self._save_now(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final state of a fit that ended otherwise (max_epochs), unless it was just written."""
        self._save_now(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """On SIGTERM, the state after the last finished batch. Lightning stops at a batch's end, every
        rank at the same one (``callbacks.sigterm.SyncedSigterm``), so that state is whole; other
        exceptions may strike mid-step and leave the previous ``last.ckpt`` alone."""
        if isinstance(exception, SIGTERMException):
            self._save_now(trainer)

    def _save_now(self, trainer: L.Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
