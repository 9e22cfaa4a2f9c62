"""The error every bad row raises, and where the normaliser is while reading one (for its message)."""

from __future__ import annotations

from typing import NoReturn

REASONS: tuple[str, ...] = (
    "missing_column",
    "wrong_type",
    "image_count_mismatch",
    "missing_image",
    "corrupt_image",
    "no_answer",
)


class RowError(ValueError):
    """A bad row: says which source, row index and column, and why (``reason`` is one of REASONS)."""

    def __init__(self, source: str, index: int, column: str, reason: str, detail: str) -> None:
        super().__init__(f"{source}, row {index}, column {column!r}: {detail} [{reason}]")
        self.source, self.index, self.column, self.reason, self.detail = source, index, column, reason, detail


class RowAt:
    """Where we are (for error messages) while normalising one row."""

    def __init__(self, source: str, index: int) -> None:
        self.source, self.index = source, index

    def fail(self, column: str, reason: str, detail: str) -> NoReturn:
        raise RowError(self.source, self.index, column, reason, detail)
