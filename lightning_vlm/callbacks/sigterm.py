"""SIGTERM on several processes: every rank stops at the same batch, so ``last.ckpt`` gets written.

A scheduler (SLURM's preemption, ``scancel``, a time limit) signals every task, but not at the same
instant, and a rank may get it alone (``kill`` of one process). Lightning 2.6 reacts per rank: its
handler runs a ``broadcast`` from inside the signal handler, wherever the program was, and its loops
raise ``SIGTERMException`` at the end of the batch where that rank's flag was set. A rank that got the
signal one batch before another then ran the checkpoint's collectives against the other's gradient
all-reduce: measured on 2 DDP processes, the job hung until killed and wrote no ``last.ckpt``.

Here the handler only records the signal (and passes it on to the processes Lightning's own launcher
started, as Lightning's does). At the end of every training and validation batch the ranks agree, in
one all-reduce of a flag, whether any of them got it; only then is Lightning's ``received_sigterm`` set,
on every rank at the same batch, and its loops stop there together (``LastCheckpoint.on_exception``
saves). One process decides alone, with no collective. SLURM's requeue signal (Lightning's auto-requeue:
SIGUSR1) stops the same way, and rank 0 then requeues the job (:func:`requeue_if_asked`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class SyncedSigterm(L.Callback):
    """Replaces Lightning's SIGTERM notifier with one that only records the signal, and turns it into
    Lightning's stop at the end of the first batch where every rank has agreed that one got it."""

    def __init__(self) -> None:
        self.received = False  # this rank's signal, not yet agreed on
        self.requeue = False  # this rank's signal was SLURM's requeue signal
        self.requeue_agreed = False  # some rank's was, agreed with the stop
        self._trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Runs before Lightning registers its handlers in the same run (Trainer._run), which look the
        # handlers up on the connector: attributes set here replace them for this and later runs.
        self._trainer = trainer
        trainer._signal_connector._sigterm_notifier_fn = self._notify  # type: ignore[method-assign]
        # Lightning's SLURM auto-requeue (SIGUSR1, or SLURMEnvironment's requeue_signal) saved a checkpoint
        # from inside the handler, wherever the step was (on several ranks, its collectives against the
        # others' work), requeued the job and trained on: it now stops as SIGTERM does, then requeues.
        trainer._signal_connector._slurm_sigusr_handler_fn = self._notify_requeue  # type: ignore[method-assign]

    def _notify(self, signum: int, frame: Any) -> None:
        trainer = self._trainer
        assert trainer is not None
        log.info(
            "[rank %d] Received SIGTERM: stopping at the end of the batch in progress", trainer.global_rank
        )
        launcher = trainer.strategy.launcher
        if not self.received and launcher is not None:
            launcher.kill(signum)  # the ranks Lightning's launcher started (torchrun and SLURM signal theirs)
        self.received = True

    def _notify_requeue(self, signum: int, frame: Any) -> None:
        assert self._trainer is not None
        log.info(
            "[rank %d] Received SLURM's requeue signal (%d): stopping at the end of the batch in progress, "
            "then requeueing the job",
            self._trainer.global_rank,
            signum,
        )
        self.received = self.requeue = True

    def agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank got SIGTERM or SLURM's requeue signal (a collective: every rank calls it at the
        same point); sets Lightning's ``received_sigterm`` on every rank when one did."""
        flags = torch.tensor(
            [self.received, self.requeue], dtype=torch.int64, device=trainer.strategy.root_device
        )
        received, requeue = (bool(v) for v in trainer.strategy.reduce(flags, reduce_op="sum").tolist())
        if received:
            trainer._signal_connector.received_sigterm = True
        self.requeue_agreed |= requeue
        return trainer.received_sigterm

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.agreed(trainer)

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.agreed(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A stop agreed at the batch this validation follows: Lightning would run a validation batch (for
        # online methods, generations) first, while a scheduler's grace period runs. Stopping here saves
        # what a stop during that batch saves: the batch trained, the validation skipped. No collective:
        # the flag was agreed, and rank 0's progress bar syncs logged metrics at hooks where other ranks
        # do not (an all-reduce added at an epoch's or a validation's end hung against it).
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and trainer.received_sigterm:
            raise SIGTERMException


def raise_on_sigterm(trainer: L.Trainer) -> None:
    """After a validation outside fit (before it, or the final one): a SIGTERM any rank got during it
    ends the job on every rank. Lightning's validation loop raises only before other batches, and its next
    fit forgets the signal, so the job would train on until it is killed."""
    synced = _synced(trainer)
    if synced.agreed(trainer) if synced else trainer.received_sigterm:
        raise SIGTERMException


@contextmanager
def sigterm_recorded(trainer: L.Trainer) -> Iterator[None]:
    """Records SIGTERM in hooks that run before Lightning registers its signal handlers (``on_fit_start``,
    e.g. DPO's reference precompute), for :func:`raise_on_sigterm` to stop on. There the default action
    ended the process at once, before anything was saved. Only where signals can be set (the main
    thread) and the trainer has a :class:`SyncedSigterm`; the previous handler comes back after."""
    synced = _synced(trainer)
    if synced is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, synced._notify)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _synced(trainer: L.Trainer) -> SyncedSigterm | None:
    """The trainer's :class:`SyncedSigterm` (every train.py and eval.py run has one)."""
    return next((c for c in trainer.callbacks if isinstance(c, SyncedSigterm)), None)


def requeue_if_asked(trainer: L.Trainer) -> bool:
    """After a stop that SLURM's requeue signal asked for (``last.ckpt`` saved): rank 0 requeues the job,
    as Lightning's auto-requeue did (``scontrol requeue``; an array task by its array id). Whether one was
    asked for."""
    synced = _synced(trainer)
    if not (synced and synced.requeue_agreed):
        return False
    # The requeue ends the running job with SIGTERM to every task: ignored from here, so the shutdown
    # (W&B's finish, the last log lines) completes. Every rank ignores it before rank 0 requeues, and none
    # exits before that is done (srun --kill-on-bad-exit would end rank 0 at another's exit code 143).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer.strategy.barrier("requeue")
    if trainer.is_global_zero:
        _requeue()
    trainer.strategy.barrier("requeued")
    return True


def _requeue() -> None:
    """``scontrol requeue`` of this SLURM job (an array task by its array job's id)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else os.environ.get("SLURM_JOB_ID")
    try:
        result = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True)
    except FileNotFoundError:
        log.error("Could not requeue SLURM job %s: no scontrol on PATH; resubmit it", job)
        return
    if result.returncode:
        log.error("Could not requeue SLURM job %s (scontrol: %s); resubmit it", job, result.stderr.strip())
    else:
        log.warning("Requeued SLURM job %s", job)
