"""A repair of Lightning's epoch counters after a resume from a checkpoint on an epoch's last batch.

``train()`` adds :class:`NextEpochAfterRestart` to every run. The case it repairs: a checkpoint written at
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
