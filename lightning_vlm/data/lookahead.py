"""Training batches that can show the rows of the batches after them, for a whole optimizer step's count.

Under gradient accumulation TRL (transformers' Trainer) fetches every micro-batch of an optimizer step
before the first forward, counts their target tokens and divides each micro-batch's loss by that count,
so the step's gradient is the token mean of all its rows. Lightning hands a method one micro-batch at a
time; a :class:`LookaheadBatch` lets the method read the rows of the micro-batches that follow it in the
loader's order, pulling them from the loader early. The loader still hands each batch out once, in the
same order, so what it trains on and where a checkpoint resumes do not change.
"""

from __future__ import annotations

from collections.abc import Iterator

# Batches kept after they were handed out. A look reads the batches after the one being trained, and
# Lightning has already been handed the next (it prefetches one, to know which batch is an epoch's last):
# that one must still be here. 2 allows a prefetch of up to 3.
KEEP_BEHIND = 2


class _Pass:
    """One pass over a loader's batches, pulled on demand by the pass's generator and by looks ahead."""

    def __init__(self, batches: Iterator[list[dict]]) -> None:
        self._batches = batches
        self._pulled: dict[int, list[dict]] = {}
        self._count = 0  # batches pulled from the loader so far
        self._done = False

    def get(self, index: int) -> list[dict] | None:
        """Batch ``index`` of the pass; None past its end."""
        while self._count <= index and not self._done:
            try:
                self._pulled[self._count] = next(self._batches)
                self._count += 1
            except StopIteration:
                self._done = True
        if index >= self._count:
            return None
        if index not in self._pulled:
            raise RuntimeError(
                f"batch {index} of this pass was dropped: looked back more than {KEEP_BEHIND} batches"
            )
        return self._pulled[index]

    def forget_before(self, index: int) -> None:
        for old in [i for i in self._pulled if i < index]:
            del self._pulled[old]


class LookaheadBatch:
    """A micro-batch of training rows (``rows``) that can show the rows of the batches after it.

    Deliberately neither a sequence nor a dataclass: Lightning's batch transfer passes it through as it
    is (the rows hold no tensors; the method encodes and moves them).
    """

    __slots__ = ("rows", "index", "_pass")

    def __init__(self, rows: list[dict], index: int, batches: _Pass) -> None:
        self.rows, self.index, self._pass = rows, index, batches

    def after(self, count: int) -> list[tuple[int, list[dict]]]:
        """(index, rows) of the next ``count`` batches of this pass over the loader, fewer at its end."""
        later = [(i, self._pass.get(i)) for i in range(self.index + 1, self.index + 1 + count)]
        return [(i, rows) for i, rows in later if rows is not None]

    def __repr__(self) -> str:
        return f"LookaheadBatch(index={self.index}, rows={len(self.rows)})"


def looking_ahead(batches: Iterator[list[dict]]) -> Iterator[LookaheadBatch]:
    """``batches`` in order, each as a :class:`LookaheadBatch` of one shared pass."""
    shared = _Pass(batches)
    index = 0
    while (rows := shared.get(index)) is not None:
        shared.forget_before(index - KEEP_BEHIND)
        yield LookaheadBatch(rows, index, shared)
        index += 1
