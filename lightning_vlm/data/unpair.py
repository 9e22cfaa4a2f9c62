"""Preference pairs read as KTO's unpaired feedback, as TRL's KTOTrainer does with paired data.

TRL's KTOTrainer turns a ``chosen``/``rejected`` dataset into unpaired rows before training
(``unpair_preference_dataset``): each pair becomes its chosen answer with ``label=True`` and its
rejected answer with ``label=False``, both with the pair's prompt and images. ``UnpairedView`` does the
same lazily over any source, so ``method=kto data.train=pairs.jsonl`` trains on a DPO data set as it is.
Row ``2i`` is pair ``i``'s chosen answer and row ``2i + 1`` its rejected one; the view's name says so,
so an error about row 7 can be traced to pair 3. A pair without its chosen or rejected answer makes
both its rows bad rows (named, and skipped under ``on_bad_row=skip``). The implicit-prompt form (full
``chosen`` and ``rejected`` conversations, no ``prompt``) is split at their shared first messages, as
for DPO.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from lightning_vlm.data.loaded import Source
from lightning_vlm.data.templates import BadRow

log = logging.getLogger(__name__)


def _column(names: Mapping[str, str], ours: str, row: Mapping) -> str | None:
    """The row's column that ``column_map`` (``names``: theirs -> ours) turns into ``ours``, if any."""
    theirs = [k for k, v in names.items() if v == ours and k in row]
    if theirs:
        return theirs[0]
    return ours if ours in row and ours not in names else None


def _missing(names: Mapping[str, str], ours: str, number: int, pair: Mapping) -> BadRow:
    """The row a pair without its ``ours`` answer becomes: an error naming the column as the data names
    it. Both rows of the pair fail (not only the one that reads the answer): half a pair would tip
    the label balance, and an implicit prompt is found from both answers."""
    theirs = next((k for k, v in names.items() if v == ours), ours)
    columns = sorted(k for k, v in pair.items() if v is not None)
    detail = (
        f"pair {number} has no {theirs!r} answer (columns: {columns}); KTO reads a preference pair as "
        "its chosen and its rejected answer, so every pair needs both"
    )
    return BadRow(theirs, "missing_column", detail)


def is_paired(row: Mapping, column_map: Mapping[str, str]) -> bool:
    """Whether a raw row is a preference pair (chosen and rejected, no completion) after ``column_map``."""
    return all(_column(column_map, c, row) is not None for c in ("chosen", "rejected")) and (
        _column(column_map, "completion", row) is None
    )


class UnpairedView(Sequence):
    """Pairs as unpaired rows: ``2i`` is pair ``i``'s chosen answer (label True), ``2i + 1`` its rejected one."""

    def __init__(self, pairs: Sequence[Mapping], column_map: Mapping[str, str]) -> None:
        self.pairs, self.column_map = pairs, dict(column_map)

    def __len__(self) -> int:
        return 2 * len(self.pairs)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        pair = dict(self.pairs[index // 2])
        columns = {ours: _column(self.column_map, ours, pair) for ours in ("chosen", "rejected")}
        for ours, column in columns.items():
            if column is None or pair[column] is None:  # stored datasets fill absent keys with None
                return _missing(self.column_map, ours, index // 2, pair)
        chosen, rejected = (pair.pop(column) for column in columns.values())
        prompt = _column(self.column_map, "prompt", pair)
        if (
            (prompt is None or pair[prompt] is None)
            and isinstance(chosen, list)
            and isinstance(rejected, list)
        ):
            # Implicit prompt: the shared first messages are the prompt, the rest the two answers.
            n = 0
            while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
                n += 1
            pair[prompt or "prompt"], chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if chosen == rejected:  # one answer would train as desirable and as undesirable
            theirs = columns["chosen"]
            detail = f"pair {index // 2}: 'chosen' and 'rejected' are the same answer; KTO would read it as desirable and as undesirable"
            return BadRow(theirs, "wrong_type", detail)
        desirable = index % 2 == 0
        return {**pair, "completion": chosen if desirable else rejected, "label": desirable}


def unpair(source: Source, column_map: Mapping[str, str]) -> Source:
    """``source`` itself when its rows are unpaired (or it is empty), else its pairs as unpaired rows."""
    if len(source.rows) == 0 or not is_paired(source.rows[0], column_map):
        return source
    log.info(
        "%s holds preference pairs (chosen/rejected): KTO reads each as two unpaired rows, the chosen "
        "answer desirable and the rejected one undesirable (%d pairs -> %d rows)",
        source.name,
        len(source.rows),
        2 * len(source.rows),
    )
    name = f"{source.name}, unpaired (row 2i: pair i's chosen answer, row 2i+1: its rejected one)"
    # Both rows of pair i come from its file: their images start beside it.
    dirs = None if source.row_dirs is None else [d for d in source.row_dirs for _ in range(2)]
    return Source(UnpairedView(source.rows, column_map), name, source.base_dir, source.trusted, dirs)
