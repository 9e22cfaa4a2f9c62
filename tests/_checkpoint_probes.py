"""Real faults in real checkpoint writes, and a probe of what is on disk (tests/test_checkpoints.py).

Set through config like the production plugin (``trainer.plugins=[{_target_: _checkpoint_probes...}]``),
so a ``train.py`` subprocess runs them too (``PYTHONPATH`` holds tests/).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import IO, Any

import lightning as L
import torch

from lightning_vlm.checkpoint_io import AtomicCheckpointIO


class _FaultAfter:
    """A file for ``torch.save``: writes go through to ``file``; once ``limit`` bytes are in, ``fault()``."""

    def __init__(self, file: IO[bytes], limit: int, fault) -> None:
        self.file, self.limit, self.fault, self.written = file, limit, fault, 0

    def write(self, data: bytes) -> int:
        n = self.file.write(data)
        self.written += n
        if self.written >= self.limit:
            self.file.flush()
            os.fsync(self.file.fileno())  # the partial file is on disk, as a real crash would leave it
            self.fault()
        return n

    def flush(self) -> None:
        self.file.flush()


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _disk_full() -> None:
    raise OSError(28, "No space left on device")


class FaultyCheckpointIO(AtomicCheckpointIO):
    """The production plugin, whose ``fault_on_save``-th write stops after ``after_bytes`` bytes of
    ``torch.save``'s output: ``fault="kill"`` SIGKILLs the process, ``"disk_full"`` raises ``OSError``.
    ``temp_files`` records where each write went."""

    def __init__(self, fault_on_save: int, after_bytes: int, fault: str = "kill") -> None:
        super().__init__()
        self.fault_on_save, self.after_bytes = fault_on_save, after_bytes
        self.fault = {"kill": _sigkill, "disk_full": _disk_full}[fault]
        self.saves = 0
        self.temp_files: list[Path] = []

    def write(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        self.saves += 1
        self.temp_files.append(Path(file.name))
        if self.saves == self.fault_on_save:
            file = _FaultAfter(file, self.after_bytes, self.fault)
        super().write(checkpoint, file)


def saved_step(path: Path) -> int | None:
    """``global_step`` of the checkpoint at ``path`` (loaded as training loads it), ``None`` if absent."""
    if not path.exists():
        return None
    return torch.load(path, weights_only=True, map_location="cpu")["global_step"]


class LastOnDisk(L.Callback):
    """Records, at each training batch start, the step of the ``last.ckpt`` on disk then."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seen: dict[int, int | None] = {}

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.seen[trainer.global_step] = saved_step(self.path)


class CrashInValidation(L.Callback):
    """Raises (an OOM, a node failure) in the middle of the validation at ``at_step``."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking and trainer.global_step == self.at_step:
            raise RuntimeError(f"crash in the validation of step {self.at_step}")


class ValidationSteps(L.Callback):
    """Records the step of every validation that ran to its end (sanity checks aside)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seen.append(trainer.global_step)
