"""Bad rows under ``data.on_bad_row``: the setup scan that finds them, what a row skipped at load
becomes, and clear errors when skipping leaves nothing (a source, or a batch, with no rows at all).

``on_bad_row="error"`` raises the first :class:`RowError`. ``"skip"`` counts skips per reason and
logs them; but a source whose every row was skipped, or a batch whose every row failed to decode,
would otherwise surface as an empty dataset or an empty batch deep inside a method (a traceback far
from the cause), so both raise :class:`NoRowsError` naming the setting, the source and the rows.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from lightning_vlm.data.images import IMAGE_SUFFIXES
from lightning_vlm.data.row_error import RowError

if TYPE_CHECKING:  # sources/templates import datasets machinery; only their types are needed here
    from lightning_vlm.data.loaded import Source
    from lightning_vlm.data.templates import RowFormat

logger = logging.getLogger("lightning_vlm.data")
SETTING = "data.on_bad_row=skip"


class NoRowsError(ValueError):
    """Nothing is left to train or validate on: a source, or a batch, without a single usable row."""


@dataclass(frozen=True)
class SkippedRow:
    """What a dataset item is when its row was skipped at load (an image failed to decode)."""

    source: str
    index: int
    reason: str
    message: str


def _counts(skipped: Counter) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))


def scan(
    source: Source,
    row_format: RowFormat,
    limit: int | None = None,
    on_bad_row: str = "error",
) -> tuple[list[int], Counter]:
    """Run the cheap checks on the first ``limit`` rows; returns the good row indices and skips per reason."""
    total = len(source.rows) if limit is None else min(limit, len(source.rows))
    if source.trusted:
        return list(range(total)), Counter()
    good, skipped, first = [], Counter(), {}
    with_images, first_good = 0, None
    for index, row in enumerate(source.rows):
        if index >= total:
            break
        try:
            normalized = row_format.normalize(row, index, source.name, source.dir_of(index))
        except RowError as e:
            if on_bad_row == "error":
                raise
            skipped[e.reason] += 1
            first.setdefault(e.reason, str(e))
            continue
        good.append(index)
        with_images += bool(normalized["images"])
        first_good = normalized if first_good is None else first_good
    if first_good is not None and not with_images:
        _warn_unread_images(first_good, source.name)
    if skipped:
        # One line for the whole source (a million bad rows must not mean a million log lines), with
        # the first row of each reason, so the fix can start there.
        examples = "; ".join(f"first {reason}: {message}" for reason, message in sorted(first.items()))
        logger.warning(
            "skipped %d of %d rows of %s: %s (%s)",
            sum(skipped.values()),
            total,
            source.name,
            _counts(skipped),
            examples,
        )
    return good, skipped


def _looks_like_image(value: object) -> bool:
    if isinstance(value, list | tuple):
        return bool(value) and all(map(_looks_like_image, value))
    if isinstance(value, dict):
        return "bytes" in value
    return (isinstance(value, str) and value.lower().endswith(IMAGE_SUFFIXES)) or isinstance(
        value, Image.Image
    )


def _warn_unread_images(row: dict, name: str) -> None:
    """A source without one image whose rows hold image-like columns the row format does not read
    ("image_path", "img", "file_name"): the run would train text-only, so say which columns to map."""
    columns = sorted(
        column for column, value in row.items() if column != "images" and _looks_like_image(value)
    )
    if columns:
        logger.warning(
            "%s: no row has an image (the 'image' or 'images' column), but column(s) %s hold images: the "
            "run trains text-only; map one, e.g. data.column_map={%s: image} ({...: images} for a list)",
            name, columns, columns[0],
        )  # fmt: skip


def require_rows(good: list[int], skipped: Counter, source: Source, setting: str) -> None:
    """Raise NoRowsError when a source that is used (``setting``: ``data.train``/``data.val``) has no
    good row: every row skipped (naming ``data.on_bad_row=skip``), or none to begin with."""
    if good:
        return
    role = "training" if setting == "data.train" else "validation"
    if skipped:
        raise NoRowsError(
            f"{source.name}: {SETTING} skipped every one of its {sum(skipped.values())} rows "
            f"({_counts(skipped)}; the warning above names the first row of each), so no {role} rows are "
            f"left. Fix those rows, or point {setting} at other data"
        )
    raise NoRowsError(f"no usable {role} rows in {source.name} ({setting}): it has none")


def collate_rows(batch: list[dict | SkippedRow | None]) -> list[dict]:
    """Keep the batch a list of row dicts (the model wrapper tokenises); drop rows skipped at load.

    A batch of nothing but skipped rows raises NoRowsError naming the setting, source and rows: an
    empty batch would fail inside the method, far from its cause."""
    rows = [row for row in batch if row is not None and not isinstance(row, SkippedRow)]
    skips = [row for row in batch if isinstance(row, SkippedRow)]
    if rows or not skips:
        return rows
    reasons = _counts(Counter(s.reason for s in skips))
    raise NoRowsError(
        f"{skips[0].source}: every row of a batch was skipped at load under {SETTING} (rows "
        f"{[s.index for s in skips]}: {reasons}; first: {skips[0].message}), leaving an empty batch. "
        "Images are only decoded when a batch is built, so setup cannot drop these rows: fix or remove "
        "them"
    )
