"""A DataLoader that Lightning can resume mid-epoch: same order, next unseen batch, after a restart.

Lightning saves ``state_dict()`` of any train loader that has one into the checkpoint and calls
``load_state_dict`` before iterating again on resume. The order of epoch ``e`` is a permutation
seeded by ``seed + e`` (Lightning calls ``sampler.set_epoch``), so it does not depend on how many
epochs ran in this process, and resuming skips the indices already drawn without loading them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class EpochSeededSampler(Sampler[int]):
    """Indices ``0..n-1``, shuffled by a generator seeded with ``seed + epoch`` (or in order)."""

    def __init__(self, length: int, seed: int = 0, shuffle: bool = True) -> None:
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.epoch = 0
        self.start = 0  # indices of this epoch already consumed before a restart

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of each epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(
                self.length, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
        else:
            order = torch.arange(self.length)
        start, self.start = self.start, 0
        return iter(order[start:].tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`EpochSeededSampler` whose position is saved in checkpoints."""

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int = 0, shuffle: bool = True, **kwargs: Any
    ) -> None:
        sampler = EpochSeededSampler(len(dataset), seed=seed, shuffle=shuffle)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._fetched = 0  # batches handed out in the current pass

    def __iter__(self):
        self._fetched = self.sampler.start // self.batch_size
        for batch in super().__iter__():
            self._fetched += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Epoch and number of batches handed out so far in it."""
        return {"epoch": self.sampler.epoch, "batches": self._fetched}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved epoch after its last handed-out batch."""
        self.sampler.epoch = state["epoch"]
        self.sampler.start = state["batches"] * self.batch_size
