"""How one generation's completions split into optimizer steps and micro-batches, the same on every rank.

Every rank must run the same number of optimizer steps (DDP all-reduces gradients once per step),
and, wherever a forward pass is itself a collective, the same number of forward passes: FSDP
gathers each unit's weights in every forward, and ``top_entropy_quantile`` takes its threshold over
every rank's micro-batch. Ranks usually hold equal shards, but not always: a row whose image fails
to decode under ``data.on_bad_row=skip`` leaves its rank a shorter batch. Each rank therefore derives
its layout from every rank's size (``Shard.sizes``, known everywhere), so all ranks agree without
another exchange, and a short rank cannot leave the others waiting in a collective.

A *unit* is what must stay inside one micro-batch: one completion, or Online DPO's pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _step_lengths(units: int, parts: int) -> list[int]:
    """Units per step when ``units`` split into ``parts`` consecutive steps one unit apart at most."""
    return [len(step) for step in torch.arange(units).tensor_split(parts)]


def micro_counts(unit_sizes: Sequence[int], parts: int, per_micro: int | None) -> list[int]:
    """Micro-batches in each of ``parts`` steps, common to all ranks (``unit_sizes``: each rank's units).

    The most any rank needs to keep its micro-batches within ``per_micro`` units, so equal shards keep
    their usual layout; but never more than the shortest rank's units in that step, since a
    micro-batch cannot be empty. Only then (a rank with under 1/``per_micro`` of another's units) do
    the longer ranks' micro-batches exceed ``per_micro``.
    """
    lengths = [_step_lengths(n, parts) for n in unit_sizes]
    counts = []
    for step in zip(*lengths, strict=True):
        needed = max(1 if per_micro is None else math.ceil(n / per_micro) for n in step)
        counts.append(min(needed, min(step)))
    return counts


def index_chunks(
    n: int, parts: int, size: int | None, unit: int = 1, counts: Sequence[int] | None = None
) -> list[list[torch.Tensor]]:
    """``n`` completions in ``parts`` consecutive optimizer-step chunks, each in micro-batches of at most
    ``size`` completions (``None``: one micro-batch a step), whole units of ``unit`` completions each.

    When ``parts`` does not divide the units (an epoch's short last batch) the first steps take one
    unit more: every completion trains once, in steps as even as they can be. Never more steps than
    units. ``counts`` (``micro_counts``) fixes each step's number of micro-batches; a step whose own
    layout has another number splits into that many, as evenly as it can.
    """
    if n % unit:
        raise ValueError(f"{n} completions do not split into whole units of {unit}")
    units = torch.arange(n // unit)
    parts = max(min(parts, len(units)), 1)
    per_micro = None if size is None else max(size // unit, 1)
    chunks = []
    for s, step in enumerate(units.tensor_split(parts)):
        width = per_micro or len(step)
        pieces = [step[i : i + width] for i in range(0, len(step), width)]
        if counts is not None and counts[s] != len(pieces):
            pieces = list(step.tensor_split(counts[s]))
        chunks.append([(piece.unsqueeze(-1) * unit + torch.arange(unit)).reshape(-1) for piece in pieces])
    return chunks


def rank_chunks(
    sizes: Sequence[int], rank: int, parts: int, size: int | None, unit: int = 1
) -> list[list[torch.Tensor]]:
    """This rank's steps and micro-batches when the ranks hold ``sizes`` completions: the same number of
    steps on every rank (at most the shortest rank's units) and the same micro-batches per step."""
    unit_sizes = [n // unit for n in sizes]
    parts = max(min(parts, *unit_sizes), 1)
    per_micro = None if size is None else max(size // unit, 1)
    return index_chunks(sizes[rank], parts, size, unit, micro_counts(unit_sizes, parts, per_micro))
