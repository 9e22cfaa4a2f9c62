"""Random-number states in every checkpoint, so that a resumed run draws what the uninterrupted one would.

Lightning saves none, and dropout (LoRA's ``lora_dropout``) draws its masks from torch's generator: a
resumed run then trained on other masks (measured: 0.004 apart after 3 steps at dropout 0.1). HF's
Trainer, and so TRL, saves one ``rng_state_<rank>.pth`` per process; here each process's states go into
the checkpoint (gathered to the process that writes it) and are restored when the resumed run's first
batch starts, where the uninterrupted run's next draw comes from. Sampling and the data order are
seeded per step and per epoch already (``generation``, ``data.resumable``): this is for the rest.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch

log = logging.getLogger(__name__)
KEY = "rng_states"


def collect() -> dict[str, Any]:
    """This process's generator states, as plain containers and tensors (checkpoints load weights-only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states: dict[str, Any]) -> None:
    """Set this process's generators to ``states`` (from :func:`collect`)."""
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        # One state per GPU seen when saved: a machine with fewer visible GPUs restores those it has.
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


def _gathered(states: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's ``states``, by rank (every process saves a checkpoint together, Lightning's rule)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [states]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, states)
    return out


class RngStates(L.Callback):
    """Saves every process's random-number states in each checkpoint and restores them at the first batch
    of a run resumed from it, on as many processes (another count resumes with the run's own states)."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Adds the states of every process, gathered by rank."""
        checkpoint[KEY] = _gathered(collect())

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keeps this process's states for the first batch (loading happens before other draws)."""
        states = checkpoint.get(KEY)
        if states and len(states) == trainer.world_size:
            self._pending = states[trainer.global_rank]
        elif states:
            log.info("checkpoint written by %d processes, resumed on %d: random-number states not restored",
                     len(states), trainer.world_size)  # fmt: skip

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Restores the loaded states once, where the interrupted run's next draw came from."""
        if self._pending is not None:
            restore(self._pending)
            self._pending = None
