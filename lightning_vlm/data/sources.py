"""Where rows come from: the synthetic task, a Hub dataset, a ``save_to_disk`` folder, or a local file.

A source spec is a string (``"synthetic"``, a Hub name, a folder, a ``.json``/``.jsonl``/``.parquet``
file) or a dict ``{"path": ..., "subset": ..., "split": ...}`` (plus, for ``"synthetic"``, the options
``num_samples``, ``seed``, ``kinds``, ``image_size``). ``split`` takes datasets' syntax
(``train[:80%]``) for every kind; a file or a saved Dataset is one split, ``train``. Every source is
read lazily, row by row, so images stay on disk (or encoded in Arrow) until a batch needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_vlm.data import grounding, vqa
from lightning_vlm.data.files import (
    ARCHIVE_ERRORS,
    FILE_BUILDERS,
    SourceError,
    data_suffix,
    has_json_feature,
    json_rows_readable,
    load_file,
    one_split,
    pick_rows,
    read_json_rows,
    select_rows,
    split_names,
)
from lightning_vlm.data.synthetic import QUESTIONS, ROW_BUILDERS, build_row, make_sample

SPEC_KEYS: tuple[str, ...] = ("path", "subset", "split", "num_samples", "seed", "kinds", "image_size")
logger = logging.getLogger("lightning_vlm.data")
SYNTHETIC_DEFAULTS: dict[str, Any] = {"num_samples": 256, "seed": 0, "kinds": ("color",), "image_size": 112}


@dataclass
class Source:
    """The raw rows of one split, a name for error messages, and the folder relative image paths start in."""

    rows: Sequence[Mapping]
    name: str
    base_dir: Path | None = None
    trusted: bool = False  # rows we generate ourselves: no need for the validation pass


class SyntheticRows(Sequence):
    """The synthetic task as a lazy sequence of raw rows: sample ``i`` is drawn only when asked for."""

    def __init__(
        self, shape: str, num_samples: int, seed: int, kinds: Sequence[str], image_size: int
    ) -> None:
        if shape not in ROW_BUILDERS:
            raise ValueError(f"unknown data shape {shape!r}; expected one of {tuple(ROW_BUILDERS)}")
        # "grounding" (a box for a named colour, data/grounding.py) is a task of its own: its answers
        # are boxes for iou_reward, not words, so it does not mix with the question kinds.
        self.grounding = "grounding" in kinds
        if self.grounding and tuple(kinds) != ("grounding",):
            raise ValueError(
                f"synthetic kind 'grounding' cannot be mixed with others, got kinds={list(kinds)}"
            )
        if self.grounding and shape not in grounding.ROW_BUILDERS:
            raise ValueError(
                f"the synthetic grounding task has no {shape!r} rows; it has {tuple(grounding.ROW_BUILDERS)}"
            )
        self.shape, self.num_samples, self.seed = shape, num_samples, seed
        self.kinds, self.image_size = tuple(kinds), image_size
        # Colour, shape and count alone keep synthetic.py's own stream (every figure measured on it);
        # the answer-reward kinds (data/vqa.py) mix with them on a stream of their own.
        self.classic = set(kinds) <= set(QUESTIONS)
        self._sample(0)  # fail now on a bad kind or size, not inside a worker

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        return self._sample(index)

    def _sample(self, index: int) -> dict:
        if self.grounding:
            sample = grounding.make_grounding_sample(self.seed, index, self.image_size)
            return grounding.ROW_BUILDERS[self.shape](sample)
        draw = make_sample if self.classic else vqa.make_vqa_sample
        return build_row(self.shape, draw(self.seed, index, self.kinds, self.image_size), index)


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


def plain(spec: Any) -> Any:
    """Hydra passes DictConfig/ListConfig; turn them into plain containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra (and so omegaconf) is a dependency
        return spec
    if isinstance(spec, DictConfig | ListConfig):
        return OmegaConf.to_container(spec, resolve=True)
    return spec


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or data_suffix(Path(spec)) in FILE_BUILDERS


def _from_disk(folder: Path, split: str, explicit: bool) -> Source:
    import datasets

    loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        missing = sorted(split_names(split) - set(loaded))
        if missing:
            raise SourceError(
                f"{folder} is a DatasetDict without split {', '.join(map(repr, missing))}; it has {list(loaded)}"
            )
        splits = dict(loaded)
    else:
        splits, split = {"train": loaded}, one_split(split, explicit)
    loaded = select_rows(splits, split, str(folder))
    if has_json_feature(loaded.features):  # stored as datasets' JSON text: the original strings are gone
        _warn_json_text(f"{folder} [{split}]")
    return Source(DatasetRows(loaded), f"{folder} [{split}]", folder)


def _from_file(path: Path, split: str, explicit: bool) -> Source:
    # files.load_file turns the loaders' errors into ones naming the file, line and byte offset.
    dataset = load_file(path)
    split = one_split(split, explicit)
    name = str(path) if split == "train" else f"{path} [{split}]"  # row numbers count from the slice
    if has_json_feature(dataset.features):
        if json_rows_readable(path):
            # Mixed-type fields come back from datasets' JSON text with strings such as "4" turned into
            # numbers (files.read_json_rows): read the rows as written instead (held in memory).
            rows = read_json_rows(path)
            picked = [
                rows[i] for _, indices in pick_rows(split, {"train": len(rows)}, str(path)) for i in indices
            ]
            return Source(picked, name, path.parent)
        _warn_json_text(name)  # parquet holding datasets' JSON text: its rows are all there is
    return Source(DatasetRows(select_rows({"train": dataset}, split, str(path))), name, path.parent)


def _load_dataset(name: str, subset: str | None, split: str, folder: bool = False) -> Any:
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


def _from_hub(name: str, subset: str | None, split: str) -> Source:
    dataset = _load_dataset(name, subset, split)
    if has_json_feature(dataset.features):
        _warn_json_text(f"{name} [{split}]")
    return Source(DatasetRows(dataset), f"{name} [{split}]")


def _warn_json_text(name: str) -> None:
    """For rows only ``datasets`` reads: its JSON-text fields may have changed some strings."""
    logger.warning(
        "%s: some field changes type between rows, and datasets reads strings that look like JSON "
        "('4', 'true', '[1, 2]') back as numbers, booleans or lists; local .json/.jsonl files, plain or "
        "gzip/bz2/xz-compressed, are read exactly (a save_to_disk or parquet copy of them is not)",
        name,
    )


def _from_folder(folder: Path, subset: str | None, split: str) -> Source:
    """A plain folder of data files: the datasets library infers the builder and the splits from the
    file names (``train.jsonl``, ``validation.jsonl``, ...)."""
    import datasets

    dataset = _load_dataset(str(folder), subset, split, folder=True)
    name = f"{folder} [{split}]"
    if not has_json_feature(dataset.features):
        return Source(DatasetRows(dataset), name, folder)
    # The same JSON-text fields as in a single file (_from_file): read the split's files as written.
    # ``split`` may be a slice spec ("train[:80%]+validation"): each named split's files, then the slices.
    data_files = datasets.load_dataset_builder(str(folder), name=subset).config.data_files
    named = {str(s): [Path(f) for f in files] for s, files in data_files.items()}
    if split == "all":  # as datasets reads it: every split, in order
        split = "+".join(named)
    wanted = split_names(split)
    named = {s: files for s, files in named.items() if s in wanted}
    if wanted - set(named) or not all(json_rows_readable(f) for files in named.values() for f in files):
        _warn_json_text(name)  # a zip or zstd archive, or a spec we do not follow: datasets' rows, said so
        return Source(DatasetRows(dataset), name, folder)
    try:
        read = {s: [row for f in files for row in read_json_rows(f)] for s, files in named.items()}
    except (ValueError, *ARCHIVE_ERRORS) as e:  # a file datasets read by its content, not its name
        logger.warning("%s: could not re-read %s with Python's json (%s)", name, list(named), e)
        _warn_json_text(name)
        return Source(DatasetRows(dataset), name, folder)
    rows = [
        read[s][i]
        for s, indices in pick_rows(split, {s: len(r) for s, r in read.items()}, name)
        for i in indices
    ]
    if len(rows) != len(dataset):  # the files are not the ones datasets read: never guess
        raise SourceError(
            f"{name}: datasets read {len(dataset)} rows from {folder}, Python's json {len(rows)}; pass the "
            "split's files one at a time to find the one that differs"
        )
    return Source(rows, name, folder)


def synthetic_source(
    shape: str,
    split: str = "train",
    num_samples: int = 256,
    seed: int = 0,
    kinds: Sequence[str] = ("color",),
    image_size: int = 112,
) -> Source:
    """The synthetic task; the train split draws from ``seed`` and every other split from ``seed + 1``."""
    # make_sample seeds sample i with seed * 1_000_003 + i, so neighbouring seeds never share a
    # sample below a million rows: validation rows are never training rows.
    split_seed = seed if split == "train" else seed + 1
    rows = SyntheticRows(shape, num_samples, split_seed, kinds, image_size)
    return Source(rows, f"synthetic [{split}, seed {split_seed}]", trusted=True)


def load_source(
    spec: str | Mapping, shape: str, split: str = "train", synthetic: Mapping | None = None
) -> Source:
    """Resolve a source spec into rows of ``split``; ``synthetic`` gives defaults for the synthetic task."""
    spec = plain(spec)
    if isinstance(spec, str | Path):
        spec = {"path": str(spec)}
    if not isinstance(spec, Mapping) or "path" not in spec:
        raise SourceError(f"a source is a string or a dict with a 'path' key; got {spec!r}")
    unknown = set(spec) - set(SPEC_KEYS)
    if unknown:
        raise SourceError(f"unknown source keys {sorted(unknown)}; expected some of {SPEC_KEYS}")
    path, explicit = str(spec["path"]), spec.get("split") is not None
    split = spec.get("split") or split
    options = {k: v for k, v in spec.items() if k in SYNTHETIC_DEFAULTS}
    if path == "synthetic":
        return synthetic_source(shape, split, **{**SYNTHETIC_DEFAULTS, **(plain(synthetic) or {}), **options})
    if options:
        raise SourceError(f"{sorted(options)} only apply to the 'synthetic' source, not {path!r}")
    local = Path(path).expanduser()
    if local.is_dir():
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            return _from_disk(local, split, explicit)
        return _from_folder(local, spec.get("subset"), split)
    if local.is_file():
        return _from_file(local, split, explicit)
    if _looks_like_path(path):
        raise SourceError(f"no such file or folder: {local.resolve()}")
    return _from_hub(path, spec.get("subset"), split)
