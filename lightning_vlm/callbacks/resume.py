"""Repairs of Lightning's epoch counters after a resume, which ``train()`` adds to every run.

:class:`BatchCountAfterResume`: Lightning ends an epoch when its count of the epoch's batches reaches
the loader's length, and restores that count from the checkpoint; our loader resumes by samples. With
another global batch (``data.batch_size``, or another number of processes) the restored count is in
the old batch size, so the epoch ended early (with batches of 4 -> 8, after 3 of the 6 batches left).

:class:`NextEpochAfterRestart`. The case it repairs: a checkpoint written at
the end of an epoch's last batch (``last.ckpt`` on a step schedule that lands there, or a kill just
after it) records the epoch as started but not finished. On resume, Lightning's ``FitLoop.reset``
finishes that epoch (``processed``/``completed`` go up), but its restart stage stays "mid-epoch", so the
*next* epoch's ``on_advance_start`` neither counts it as ready/started nor calls the
``on_train_epoch_start`` hooks (Lightning 2.6). The weights still follow the uninterrupted run, but every
checkpoint of that epoch then holds ``ready == started == processed``, which Lightning reads as "the
last epoch finished": resumed again, an epoch-budgeted run (``max_epochs``, no ``max_steps``) ignores the
saved data position and trains the whole epoch again (measured: 10 steps instead of 8, other weights).
"""

from __future__ import annotations

import lightning as L

from lightning_vlm.data.resumable import ResumableDataLoader


class NextEpochAfterRestart(L.Callback):
    """After a resume that closed the restarted epoch, lets the next epoch start as a fresh one (counted
    ready/started, ``on_train_epoch_start`` hooks called), as in the uninterrupted run."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Runs after ``FitLoop.reset`` applied the checkpoint's progress, before the first epoch starts."""
        loop = trainer.fit_loop
        progress = loop.epoch_progress.current
        # Mid-epoch restarts keep one epoch open (ready = processed + 1); none open means reset() just
        # finished the restarted epoch, and what follows is a new one.
        if getattr(loop, "restarted_mid_epoch", False) and progress.ready == progress.processed:
            loop.reset_restart_stage()


class BatchCountAfterResume(L.Callback):
    """After a resume with another global batch, sets Lightning's count of the epoch's batches so that
    the batches the loader has left end the epoch, as the loader's data does."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Runs after the loader's position is restored, before the epoch loop reads the count."""
        loader = trainer.train_dataloader
        if not isinstance(loader, ResumableDataLoader) or not loader.resumed_with_other_batch:
            return
        # Against the loader's whole epoch (len), not limit_train_batches' cut: the loader counts that.
        done = max(0, len(loader) - loader.batches_left())
        # Not rounded to whole accumulations (accumulate_grad_batches): Lightning steps when its count is a
        # multiple of k or reaches the epoch's length, so a count rounded down never reached the length
        # and the epoch's last micro-batch was never stepped. Unrounded, the first window is the rest of the
        # interrupted one, as after a resume at the same batch size.
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        # All four move together: a checkpoint saved at a batch's end holds completed = ready - 1.
        shift = done - current.ready
        current.ready, current.started = current.ready + shift, current.started + shift
        current.processed, current.completed = current.processed + shift, current.completed + shift
