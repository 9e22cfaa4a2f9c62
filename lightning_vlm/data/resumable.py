"""A DataLoader that Lightning can resume mid-epoch, on one process or many: same order, next unseen batch.

The order of epoch ``e`` is a permutation seeded by ``seed + e`` (Lightning calls
``sampler.set_epoch``), so it does not depend on how many epochs ran in this process. Under data
parallelism rank ``r`` of ``W`` takes every ``W``-th index of that order, starting at ``r`` (the
order is padded by wrapping around to a multiple of ``W``, as ``DistributedSampler`` does, so every
rank has as many batches and no collective waits for a rank that ran out). Batch ``k`` of all ranks
together is then ``order[k·B·W : (k+1)·B·W]``: the rows one process with batch ``B·W`` would train on.

Lightning saves ``state_dict()`` of any train loader that has one into the checkpoint and calls
``load_state_dict`` before iterating again on resume. The position is kept as the number of samples
of the epoch's order that all ranks consumed together, so a run resumed on another world size
continues from the same place in the order (with a warning: batches are then cut differently);
:class:`lightning_vlm.callbacks.resume.BatchCountAfterResume` then tells Lightning, which counts an
epoch's batches, how many of the new size are left.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_vlm.data.lookahead import looking_ahead

log = logging.getLogger(__name__)


class EpochSeededSampler(DistributedSampler):
    """Rank ``rank``'s share of epoch ``e``'s order (seeded by ``seed + e``, or ``0..n-1``).

    A ``DistributedSampler`` subclass so that Lightning, which injects its own sampler under DDP,
    leaves this one (and its resumable position) alone. The world is given, never looked up.
    """

    def __init__(
        self, length: int, seed: int = 0, shuffle: bool = True, num_replicas: int = 1, rank: int = 0
    ) -> None:
        # DistributedSampler.__init__ is not called: it would query torch.distributed for the world.
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank must be in [0, num_replicas), got rank={rank}, num_replicas={num_replicas}"
            )
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.num_replicas, self.rank = num_replicas, rank
        self.drop_last = False
        self.epoch = 0
        # Where a restored position applies: (epoch, samples of its order already consumed by all ranks).
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of each epoch."""
        self.epoch = epoch

    @property
    def num_samples(self) -> int:
        """Indices per rank in a whole epoch (padded order / world size)."""
        return math.ceil(self.length / self.num_replicas)

    def __len__(self) -> int:
        return self.num_samples

    def order(self, epoch: int) -> torch.Tensor:
        """The whole epoch's order over all ranks, before sharding and padding."""
        if not self.shuffle:
            return torch.arange(self.length)
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))

    def resume_at(self, epoch: int, samples: int) -> None:
        """Continue ``epoch`` after its first ``samples`` indices (counted over all ranks)."""
        self._resume = (epoch, samples)

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = min(self._resume[1], self.length)
        # A restored position belongs to its epoch only: a checkpoint written on an epoch's last batch
        # must not cut the next epoch short.
        self._resume = None
        rest = order[start:]
        pad = -len(rest) % self.num_replicas
        if pad and len(rest):
            # Wrapped around, repeated when the order is shorter than the padding (1 row, 3 ranks): a rank
            # with no batch would leave the others waiting in a collective.
            rest = torch.cat([rest, order.repeat(math.ceil(pad / len(order)))[:pad]])
        return iter(rest[self.rank :: self.num_replicas].tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`EpochSeededSampler` whose position is saved in checkpoints."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        lookahead: bool = False,
        **kwargs: Any,
    ) -> None:
        """``lookahead``: hand out :class:`~lightning_vlm.data.lookahead.LookaheadBatch` objects, which can show
        the rows of the batches after them (SFT counts a whole accumulation window's tokens first)."""
        sampler = EpochSeededSampler(
            len(dataset), seed=seed, shuffle=shuffle, num_replicas=num_replicas, rank=rank
        )
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._fetched = 0  # batches handed out in this pass over the current epoch
        self._start = 0  # samples (all ranks) of the current epoch consumed before this pass began
        # A loaded position not yet iterated: state_dict reports it (a checkpoint can be written before
        # the resumed run's first batch: a SIGTERM at the top of a batch, a stop in a resumed validation).
        self._loaded = False
        self._pass_epoch = 0  # the epoch of the pass over which _start and _fetched count
        # Set by load_state_dict when the checkpoint's global batch (rows per step, all ranks) differs.
        self.resumed_with_other_batch = False
        self.lookahead = lookahead

    def _resume_start(self) -> int:
        """Samples (all ranks) of the current epoch a pending resume skips (0 without one)."""
        sampler: EpochSeededSampler = self.sampler
        resume = sampler._resume
        return min(resume[1], sampler.length) if resume is not None and resume[0] == sampler.epoch else 0

    def __iter__(self):
        self._start, self._fetched, self._loaded = self._resume_start(), 0, False
        self._pass_epoch = self.sampler.epoch
        batches = super().__iter__()
        # Batches pulled early for a look ahead are counted when handed out: the position stays the same.
        for batch in looking_ahead(batches) if self.lookahead else batches:
            self._fetched += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Epoch, batches handed out in it (per rank), samples of its order consumed by all ranks, and what
        the order is made of (rows, seed, shuffle)."""
        sampler: EpochSeededSampler = self.sampler
        # Not yet iterated: a loaded position, or an epoch Lightning has begun (set_epoch) whose first batch
        # is not fetched yet (a SIGTERM at the top of its first step); the counts are the last pass's.
        pending = self._loaded or self._pass_epoch != sampler.epoch
        start = self._resume_start() if pending else self._start
        consumed = start + (0 if pending else self._fetched) * self.batch_size * sampler.num_replicas
        return {
            "epoch": sampler.epoch,
            "batches": start // (self.batch_size * sampler.num_replicas) + (0 if pending else self._fetched),
            "samples": min(consumed, sampler.length),
            "world_size": sampler.num_replicas,
            "batch_size": self.batch_size,
            # What the order is made of: a resume on other data or another seed continues another order.
            "length": sampler.length,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved epoch after the samples it had consumed."""
        sampler: EpochSeededSampler = self.sampler
        world = state.get("world_size", 1)
        # Checkpoints of earlier versions hold only the batch count of one process, or no batch size.
        batch = state.get("batch_size", self.batch_size)
        samples = state.get("samples", state["batches"] * batch * world)
        self.resumed_with_other_batch = batch * world != self.batch_size * sampler.num_replicas
        if world != sampler.num_replicas or self.resumed_with_other_batch:
            log.warning(
                "resuming a checkpoint written by %d processes at %d rows a step with %d processes at %d rows a "
                "step: the data order continues at sample %d of epoch %d, but batches are cut differently, so "
                "the run will not match an uninterrupted one",
                world, batch * world, sampler.num_replicas, self.batch_size * sampler.num_replicas, samples,
                state["epoch"],
            )  # fmt: skip
        saved = {k: state[k] for k in ("length", "seed", "shuffle") if k in state}  # absent in older files
        now = {"length": sampler.length, "seed": sampler.seed, "shuffle": sampler.shuffle}
        changed = {k: (v, now[k]) for k, v in saved.items() if v != now[k]}
        if changed:
            names = {"length": "training rows", "seed": "seed", "shuffle": "data.shuffle"}
            said = ", ".join(f"{names[k]} {old} -> {new}" for k, (old, new) in changed.items())
            log.warning(
                "resuming on other data than the checkpoint's (%s): epoch %d continues after sample %d of a "
                "different order, so some of its rows will be trained twice and others not at all",
                said, state["epoch"], samples,
            )  # fmt: skip
        sampler.epoch = state["epoch"]
        sampler.resume_at(state["epoch"], samples)
        self._fetched, self._loaded = 0, True

    def batches_left(self) -> int:
        """Batches the next pass over the current epoch hands out (all of them without a resume)."""
        sampler: EpochSeededSampler = self.sampler
        per_rank = math.ceil((sampler.length - self._resume_start()) / sampler.num_replicas)
        return math.ceil(per_rank / self.batch_size) if not self.drop_last else per_rank // self.batch_size
