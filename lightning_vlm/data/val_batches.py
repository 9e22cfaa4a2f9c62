"""Validation batches over several processes: every row exactly once, every rank as many batches.

Lightning gives a plain validation DataLoader a ``DistributedSampler``, which pads the rows to a multiple
of the world size by repeating some: 7 rows on 2 processes scored 8, and every ``val/*`` metric (the
best checkpoint's, a sweep's, ``eval.py``'s ``num_rows``) counted the repeats. Uneven shards without
padding would leave a rank a batch short, and a collective of that step (an FSDP forward, KTO's
gathered rows) waiting for it. Here rank r takes every W-th row from r, as ``DistributedSampler`` does
(so batch k of all ranks together is the one-process batch of ``batch_size · W`` rows), in batches of
``batch_size`` whose last takes the rest: every rank as many batches, the last one row larger on some.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch.utils.data import Dataset, DistributedSampler


class ShardBatches(DistributedSampler):
    """Rank ``rank``'s batches (lists of row indices) of ``length`` rows, each row once over all ranks.

    Every rank gets ``ceil(floor(length / W) / batch_size)`` batches: ``batch_size`` rows each, the
    last the rest of its rows (up to ``batch_size + 1`` where a rank has one row more than another).
    A ``DistributedSampler`` subclass, so Lightning leaves it in place.
    """

    def __init__(self, length: int, batch_size: int, num_replicas: int = 1, rank: int = 0) -> None:
        # DistributedSampler.__init__ is not called: it would query torch.distributed for the world.
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if 0 < length < num_replicas:
            raise ValueError(
                f"{length} validation rows on {num_replicas} processes: each process needs at least one "
                "(add rows, or validate on fewer processes)"
            )
        self.length, self.num_replicas, self.rank, self.epoch = length, num_replicas, rank, 0
        self.batch_size = batch_size
        self.num_batches = math.ceil(length // num_replicas / batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The order does not change between validations."""

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        rows = list(range(self.rank, self.length, self.num_replicas))
        for b in range(self.num_batches):
            last = b == self.num_batches - 1
            yield rows[b * self.batch_size : None if last else (b + 1) * self.batch_size]


class BatchedRows(Dataset):
    """``dataset`` read a batch of indices at a time (a DataLoader with ``batch_size=None`` over a
    sampler that yields index lists)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> list:
        return [self.dataset[i] for i in indices]
