"""The few collectives the methods need, written so they also run (as no-ops) on one process.

Every function here must be called by every rank, the same number of times and in the same order
(that is what a collective is); tensors may differ in their first dimension from rank to rank (a
rank whose rows were skipped, completions of other lengths), never in their other dimensions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def launcher_rank() -> int:
    """This process's global rank as its launcher set it (torchrun: RANK, srun: SLURM_PROCID), readable
    before any process group exists; 0 when nothing launched it. Lightning's own launcher sets no global
    rank, only LOCAL_RANK and NODE_RANK, and its processes inside an sbatch script all inherit the
    script's SLURM_PROCID=0: there a process counts as rank 0 only when each of them is 0 (else the first
    that is not, which is its global rank on one machine)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    ranks = (int(os.environ.get(key, "0")) for key in ("SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return next((r for r in ranks if r), 0)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """``x`` reduced elementwise over ranks with ``op`` (a new tensor; ``x`` itself is left as it is)."""
    if world_size() == 1:
        return x.clone()
    out = x.detach().clone()
    dist.all_reduce(out, op=op)
    return out


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``x`` over ranks (a new tensor)."""
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ranks (a new tensor)."""
    return _all_reduce(x, dist.ReduceOp.MAX)


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` on one process)."""
    if world_size() == 1:
        return [obj]
    out: list[object] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_sizes(n: int, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's ``n``, in rank order."""
    if world_size() == 1:
        return [n]
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.long, device=device))
    return [int(s.item()) for s in sizes]


def gather_cat(x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0, in rank order (sizes may differ between ranks).

    ``sizes`` (from :func:`gather_sizes`) saves the size exchange when it is already known.
    """
    if world_size() == 1:
        return x
    sizes = sizes if sizes is not None else gather_sizes(x.shape[0], x.device)
    longest = max(sizes)
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x.detach()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


@dataclass(frozen=True)
class Shard:
    """Where this rank's rows sit in the batch of all ranks (rows of lower ranks come first)."""

    sizes: tuple[int, ...]
    rank: int

    @classmethod
    def exchange(cls, n: int, device: torch.device | str = "cpu") -> Shard:
        """Every rank tells its row count (one small collective)."""
        return cls(tuple(gather_sizes(n, device)), rank())

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        """Rows of all ranks together."""
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        """Index of this rank's first row in the batch of all ranks."""
        return sum(self.sizes[: self.rank])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's per-row values -> the whole batch's, in rank order (a collective)."""
        return gather_cat(x, list(self.sizes))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The whole batch's per-row values -> this rank's rows."""
        return x[self.offset : self.offset + self.sizes[self.rank]]


def mean_normalizer(count: torch.Tensor | int | float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Σ over ranks of ``count``, divided by the world size: divide a rank's *sum* by it.

    DDP averages gradients over ranks, so ``loss = local_sum / mean_normalizer(local_count)`` makes
    the averaged gradient that of ``Σ_all_ranks sum / Σ_all_ranks count``, the mean over every rank's
    items (tokens, pairs, sequences): the one-process value, even when ranks hold different numbers
    of items. On one process it is ``count`` itself. A collective: every rank calls it.
    """
    count = torch.as_tensor(count, device=device if not torch.is_tensor(count) else count.device)
    return all_reduce_sum(count.to(torch.float32)) / world_size()


def pooled_means(
    values: dict[str, torch.Tensor], count: torch.Tensor | int | float
) -> dict[str, torch.Tensor]:
    """Means over this rank's ``count`` items -> the means over every rank's items, in one all-reduce:
    what one process holding all the rows computes (TRL gathers its logged metrics the same way).
    Detached; every value must be a mean over the same items. A collective: every rank calls it.
    """
    names = list(values)
    if world_size() == 1:
        return {k: v.detach() for k, v in values.items()}
    n = torch.as_tensor(count, dtype=torch.float32, device=values[names[0]].device)
    # A rank without items adds nothing (its means are NaN, and NaN · 0 would spread to every rank).
    stacked = torch.stack(
        [torch.where(n > 0, values[k].detach().to(torch.float32) * n, 0.0) for k in names] + [n]
    )
    sums = all_reduce_sum(stacked)
    return {k: sums[i] / sums[-1] for i, k in enumerate(names)}
