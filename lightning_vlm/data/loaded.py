"""What a source loads into (:class:`Source`), rows as the ``datasets`` library reads them, and its
loading errors turned into ones that say what to try."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_vlm.data.files import SourceError

logger = logging.getLogger("lightning_vlm.data")


@dataclass
class Source:
    """The raw rows of one split, a name for error messages, and the folder relative image paths start in."""

    rows: Sequence[Mapping]
    name: str
    base_dir: Path | None = None
    trusted: bool = False  # rows we generate ourselves: no need for the validation pass
    # Per row, where a folder's data files sit in several folders: each row's images start beside its file.
    row_dirs: Sequence[Path] | None = None

    def dir_of(self, index: int) -> Path | None:
        """The folder row ``index``'s relative image paths start in: that of the file it was read from."""
        return self.base_dir if self.row_dirs is None else self.row_dirs[index]


def _undecoded(feature: Any) -> Any:
    """The same feature tree with every ``Image`` left undecoded, so that we decode (and report) it."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(mode=feature.mode, decode=False)
    if isinstance(feature, dict):  # Features is a dict too
        return type(feature)({k: _undecoded(v) for k, v in feature.items()})
    if isinstance(feature, datasets.LargeList):
        return datasets.LargeList(_undecoded(feature.feature))
    if isinstance(feature, datasets.List):
        return datasets.List(_undecoded(feature.feature), length=feature.length)
    if isinstance(feature, list):
        return [_undecoded(feature[0])]
    return feature


class DatasetRows(Sequence):
    """A ``datasets.Dataset`` as a sequence of raw row dicts whose images are ``{"bytes", "path"}``.

    Decoding images ourselves, in the DataModule, is what lets a corrupt image name its row; it
    also keeps the validation pass from decoding every image.
    """

    def __init__(self, dataset: Any) -> None:
        self.features = _undecoded(dataset.features)
        self.table = dataset.with_format("arrow")

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        return self.features.decode_example(self.table[index].to_pylist()[0])

    def __iter__(self) -> Iterator[dict]:
        # Batched Arrow reads: one Python call per row through __getitem__ is ~10x slower.
        for batch in self.table.iter(batch_size=512):
            for row in batch.to_pylist():
                yield self.features.decode_example(row)


def load_hf_dataset(name: str, subset: str | None, split: str, folder: bool = False) -> Any:
    """``datasets.load_dataset`` of a Hub name or a plain local ``folder``, its errors as a SourceError."""
    import datasets
    from datasets import config

    try:
        return datasets.load_dataset(name, name=subset, split=split)
    except Exception as e:  # the datasets library raises many types; all mean "cannot load this"
        if folder:
            raise SourceError(
                f"could not load split {split!r} of the data files in {name}: {type(e).__name__}: {e}. The "
                "files' names give the splits (train.jsonl, validation.jsonl, test.jsonl); or pass one file"
            ) from e
        offline = " (HF_HUB_OFFLINE=1 is set: only datasets already in the local cache load)"
        raise SourceError(
            f"could not load dataset {name!r} (subset {subset!r}, split {split!r}) from the Hugging Face Hub"
            f"{offline if config.HF_HUB_OFFLINE else ''}: {type(e).__name__}: {e}. If it is local, pass "
            "a .json/.jsonl/.parquet file or a save_to_disk folder; 'synthetic' needs no download."
        ) from e


def warn_json_text(name: str) -> None:
    """For rows only ``datasets`` reads: its JSON-text fields may have changed some strings."""
    logger.warning(
        "%s: some field changes type between rows, and datasets reads strings that look like JSON "
        "('4', 'true', '[1, 2]') back as numbers, booleans or lists; local .json/.jsonl files, plain or "
        "gzip/bz2/xz-compressed, are read exactly (a save_to_disk or parquet copy of them is not)",
        name,
    )
