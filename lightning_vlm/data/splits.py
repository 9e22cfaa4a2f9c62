"""Split specs in datasets' syntax (``train[:80%]``, ``train+validation``): the rows they pick of a file
or a saved Dataset (one split, ``train``) or of a folder's splits, as ``load_dataset`` picks them of a Hub
dataset's splits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_vlm.data.files import SourceError


def split_names(split: str) -> set[str]:
    """The splits a split spec reads: ``"train[:80%]+validation"`` -> ``{"train", "validation"}``."""
    return {part.split("[")[0].strip() for part in split.split("+")}


def one_split(split: str, explicit: bool) -> str:
    """The split spec a one-split source (a file, a saved Dataset: its split is ``train``) is read with.

    ``split`` when it reads ``train`` (``train[:80%]``) or a dict spec gave it (then it must); else
    ``train``, all of it: the DataModule's split names (``validation`` for a val source) are for sources
    that have splits, and a separate validation file just works. A slice or a union of other splits
    (``validation[:3]``) was asked for, as a dict spec's split is: kept, so ``pick_rows`` says it cannot."""
    if explicit or split_names(split) == {"train"} or "[" in split or "+" in split:
        return split
    return "train"


def pick_rows(split: str, sizes: Mapping[str, int], where: str) -> list[tuple[str, range]]:
    """The rows ``split`` (datasets' split syntax) reads from splits of these ``sizes``, in order, as
    (split name, row range) pairs; one it cannot read raises naming ``where`` and the split."""
    import datasets

    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute(dict(sizes))
    except ValueError as e:
        raise SourceError(
            f"{where}: split {split!r} cannot be read ({e}); it has the split(s) {list(sizes)} (a single "
            "file or saved Dataset is one, 'train'): pick rows with datasets' split syntax, e.g. "
            "'train[:80%]' and 'train[80%:]'"
        ) from e
    return [(i.splitname, range(i.from_, i.to)) for i in instructions]


def row_dirs(
    files: Mapping[str, Sequence[Path]], counts: Mapping[Path, int], split: str, where: str
) -> list[Path]:
    """The folder of the data file each row of ``split`` comes from, in the order ``pick_rows`` picks the
    rows of these splits (``files``: split -> its files in order; ``counts``: rows per file)."""
    per_split = {s: [f.parent for f in fs for _ in range(counts[f])] for s, fs in files.items()}
    picks = pick_rows(split, {s: len(dirs) for s, dirs in per_split.items()}, where)
    return [per_split[s][i] for s, indices in picks for i in indices]


def select_rows(splits: Mapping[str, Any], split: str, where: str) -> Any:
    """The ``datasets.Dataset`` of the rows ``split`` reads from ``splits`` (name -> Dataset)."""
    import datasets

    if split in splits:
        return splits[split]
    parts = [
        splits[s].select(rows) for s, rows in pick_rows(split, {s: len(d) for s, d in splits.items()}, where)
    ]
    try:
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    except ValueError as e:  # splits whose columns differ
        raise SourceError(f"{where}: the splits of {split!r} cannot be read as one: {e}") from e
