"""KTO's ``label`` stored as a ``datasets.ClassLabel`` (a Hub or ``save_to_disk`` dataset's, one made by
``class_encode_column``): read by its class names, not by its class index.

A ClassLabel column holds each row's index into its names, and ``class_encode_column`` sorts the names:
``['desirable', 'undesirable']``, ``['accepted', 'rejected']``, ``['correct', 'incorrect']`` all put the
desirable class at index 0, which read as a 0/1 label is "undesirable". So the names decide: clearly
boolean ones (true/false, yes/no, desirable/undesirable, good/bad, accepted/rejected, chosen/rejected,
correct/incorrect, positive/negative, in any case) become True/False; any others are refused, listing
them, before training starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lightning_vlm.data.files import SourceError
from lightning_vlm.data.loaded import DatasetRows, Source

LABEL = "label"
# (desirable, undesirable) class names, compared in lower case
PAIRS = (
    ("true", "false"), ("yes", "no"), ("desirable", "undesirable"), ("good", "bad"), ("accepted", "rejected"),
    ("chosen", "rejected"), ("correct", "incorrect"), ("positive", "negative"),
)  # fmt: skip
DESIRABLE = frozenset(d for d, _ in PAIRS)
UNDESIRABLE = frozenset(u for _, u in PAIRS)


def label_column(features: Mapping[str, Any], column_map: Mapping[str, str]) -> str | None:
    """The top-level column of ``features`` that ``column_map`` (theirs -> ours) makes the ``label``."""
    theirs = [k for k, v in column_map.items() if v == LABEL and k in features]
    if theirs:
        return theirs[0]
    return LABEL if LABEL in features and LABEL not in column_map else None


def labels_of(names: Sequence[str], column: str, where: str) -> list[bool]:
    """Desirable (True) or not for each class name; SourceError naming ``where``, the column and its names
    when one does not say which."""
    words = [str(name).strip().lower() for name in names]
    unclear = [name for name, word in zip(names, words, strict=True) if word not in DESIRABLE | UNDESIRABLE]
    if unclear:
        raise SourceError(
            f"{where}: column {column!r} is a datasets ClassLabel with names {list(names)}, and {unclear} "
            "do not say whether a row is desirable; KTO's label is true (desirable) or false, and a class "
            "index says neither (class_encode_column numbers the names in sorted order). Name the classes "
            f"as one of {[f'{d}/{u}' for d, u in PAIRS]}, or store the label as booleans (true: desirable)"
        )
    return [word in DESIRABLE for word in words]


class NamedLabels(Sequence):
    """Rows whose ClassLabel ``column`` holds each row's label by its class name (True: desirable), not
    its class index; a row without a class (None, or ClassLabel's -1) keeps None: a missing label."""

    def __init__(self, rows: Sequence[Mapping], column: str, labels: Sequence[bool]) -> None:
        self.rows, self.column, self.labels = rows, column, list(labels)

    def __len__(self) -> int:
        return len(self.rows)

    def _named(self, row: Mapping) -> dict:
        index = row.get(self.column)
        known = isinstance(index, int) and 0 <= index < len(self.labels)
        return {**row, self.column: self.labels[index] if known else None}

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        return self._named(self.rows[index])

    def __iter__(self) -> Iterator[dict]:
        # through the rows' own iterator: DatasetRows reads Arrow in batches, ~10x faster than by index
        return (self._named(row) for row in self.rows)


def read_label_names(source: Source, column_map: Mapping[str, str]) -> Source:
    """``source`` with a ClassLabel label column read by its names (see module doc); any other as it is."""
    import datasets

    if not isinstance(source.rows, DatasetRows):  # JSON rows, pairs being unpaired: no class names
        return source
    column = label_column(source.rows.features, column_map)
    feature = source.rows.features.get(column) if column is not None else None
    if not isinstance(feature, datasets.ClassLabel):
        return source
    rows = NamedLabels(source.rows, column, labels_of(feature.names, column, source.name))
    return Source(rows, source.name, source.base_dir, source.trusted, source.row_dirs)
