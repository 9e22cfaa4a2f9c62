"""Where rows come from: the synthetic task, a Hub dataset, a ``save_to_disk`` folder, or a local file.

A source spec is a string (``"synthetic"``, a Hub name, a folder, a ``.json``/``.jsonl``/``.parquet``
file) or a dict ``{"path": ..., "subset": ..., "split": ...}`` (plus, for ``"synthetic"``, the options
``num_samples``, ``seed``, ``kinds``, ``image_size``). ``split`` takes datasets' syntax
(``train[:80%]``) for every kind; a file or a saved Dataset is one split, ``train``. Every source is
read lazily, row by row, so images stay on disk (or encoded in Arrow) until a batch needs them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_vlm.data import grounding, vqa
from lightning_vlm.data.files import (
    FILE_BUILDERS,
    JsonOnlyPythonReads,
    SourceError,
    data_suffix,
    has_guessed_feature,
    has_json_feature,
    json_rows_readable,
    load_file,
    read_json_rows,
)
from lightning_vlm.data.folders import from_folder
from lightning_vlm.data.image_budget import ImageBudget
from lightning_vlm.data.loaded import DatasetRows, Source, load_hf_dataset, warn_json_text
from lightning_vlm.data.splits import one_split, pick_rows, select_rows, split_names
from lightning_vlm.data.synthetic import QUESTIONS, ROW_BUILDERS, SYNTHETIC_OPTIONS, build_row, make_sample

SPEC_KEYS: tuple[str, ...] = ("path", "subset", "split", "num_samples", "seed", "kinds", "image_size")
# A synthetic source's own options, defaulting to the DataModules' training settings.
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "num_samples": SYNTHETIC_OPTIONS["num_train"],
    **{k: SYNTHETIC_OPTIONS[k] for k in ("seed", "kinds", "image_size")},
}


# Synthetic kinds whose answers are in the image's pixels (a box, a width): a resized image breaks them.
PIXEL_ANSWER_KINDS = ("grounding", "size")
MIN_IMAGE_SIZE = 16  # the smallest image every synthetic kind draws (grounding: 16, count: 14)


class SyntheticRows(Sequence):
    """The synthetic task as a lazy sequence of raw rows: sample ``i`` is drawn only when asked for."""

    def __init__(
        self, shape: str, num_samples: int, seed: int, kinds: Sequence[str], image_size: int
    ) -> None:
        if shape not in ROW_BUILDERS:
            raise ValueError(f"unknown data shape {shape!r}; expected one of {tuple(ROW_BUILDERS)}")
        if not kinds:
            raise ValueError("data.synthetic.kinds is empty: name at least one kind, e.g. [color]")
        # Checked here: a size too small for a kind fails only at the first sample of that kind, mid-run.
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < MIN_IMAGE_SIZE:
            raise ValueError(
                f"data.synthetic.image_size must be an integer >= {MIN_IMAGE_SIZE} (pixels; the grounding and "
                f"counting kinds draw their grids in no less), got {image_size!r}"
            )
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


def _without_empty_splits(folder: Path, split: str, error: IndexError) -> Any:
    """A saved dataset that datasets fails to load (``error``) because it, or one of its splits, has no rows
    (saved as no data files): its other splits, or SourceError naming the empty one asked for."""
    import datasets

    def empty(state: Path) -> bool:
        return not json.loads(state.read_text()).get("_data_files")

    if (folder / "state.json").is_file():
        if empty(folder / "state.json"):
            raise SourceError(
                f"{folder}: a saved dataset with no rows ({folder / 'state.json'} lists no data files)"
            )
        raise error
    splits = {state.parent.name: empty(state) for state in folder.glob("*/state.json")}
    if not any(splits.values()):
        raise error
    asked = set(splits) if split == "all" else split_names(split)
    for name in sorted(n for n in asked if splits.get(n)):
        raise SourceError(f"split '{name}' of {folder} holds no rows (datasets saved no data files for it)")
    return datasets.DatasetDict(
        {name: datasets.load_from_disk(str(folder / name)) for name, no_rows in splits.items() if not no_rows}
    )


def _from_disk(folder: Path, split: str, explicit: bool) -> Source:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except IndexError as error:  # datasets saves a dataset of no rows as no files, then fails to load it
        loaded = _without_empty_splits(folder, split, error)
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
        warn_json_text(f"{folder} [{split}]")
    return Source(DatasetRows(loaded), f"{folder} [{split}]", folder)


def _from_file(path: Path, split: str, explicit: bool) -> Source:
    # files.load_file turns the loaders' errors into ones naming the file, line and byte offset.
    try:
        dataset = load_file(path)
    except JsonOnlyPythonReads:
        if not json_rows_readable(path):
            raise
        dataset = None  # rows as written, below
    split = one_split(split, explicit)
    name = str(path) if split == "train" else f"{path} [{split}]"  # row numbers count from the slice
    readable = json_rows_readable(path)
    if (
        dataset is None
        or has_json_feature(dataset.features)
        or (readable and has_guessed_feature(dataset.features))
    ):
        if readable:
            # Mixed-type fields come back from datasets' JSON text with strings such as "4" turned into
            # numbers (files.read_json_rows), ISO dates as datetimes and whole numbers as floats: read
            # the rows as written instead (held in memory).
            rows = read_json_rows(path)
            picked = [
                rows[i] for _, indices in pick_rows(split, {"train": len(rows)}, str(path)) for i in indices
            ]
            return Source(picked, name, path.parent)
        warn_json_text(name)  # parquet holding datasets' JSON text: its rows are all there is
    return Source(DatasetRows(select_rows({"train": dataset}, split, str(path))), name, path.parent)


def _from_hub(name: str, subset: str | None, split: str) -> Source:
    dataset = load_hf_dataset(name, subset, split)
    if has_json_feature(dataset.features):
        warn_json_text(f"{name} [{split}]")
    return Source(DatasetRows(dataset), f"{name} [{split}]")


def check_pixel_answers(source: Source, budget: ImageBudget) -> None:
    """Refuse a budget that resizes synthetic rows whose answers are in the image's pixels: their answers
    (and the rewards scoring them) would no longer match the image the model sees."""
    if isinstance(source.rows, SyntheticRows):
        check_synthetic_budget(source.rows.kinds, source.rows.image_size, budget)


def check_synthetic_budget(kinds: Sequence[str], image_size: int, budget: ImageBudget) -> None:
    """``check_pixel_answers`` for the synthetic task's ``kinds`` and ``image_size`` settings (train.py checks
    them before the model loads)."""
    pixel_kinds = sorted(set(kinds) & set(PIXEL_ANSWER_KINDS))
    if pixel_kinds and (scaled := budget.size_for(image_size, image_size)) != (image_size, image_size):
        raise ValueError(
            f"data.image_max_pixels / data.image_min_pixels would scale the synthetic {pixel_kinds} images "
            f"({image_size}x{image_size} -> {scaled[0]}x{scaled[1]}), whose answers are in their pixels: set "
            "data.synthetic.image_size instead, or leave the budget off"
        )


def synthetic_source(
    shape: str,
    split: str = "train",
    num_samples: int = 256,
    seed: int = 0,
    kinds: Sequence[str] = ("color",),
    image_size: int = 112,
    held_out: bool | None = None,
) -> Source:
    """The synthetic task: training rows draw from ``seed``, held-out rows (validation) from ``seed + 1``.

    ``held_out`` is the rows' role (None: every split but ``train`` is held out); ``split`` only names them.
    The task has no splits to slice: a slice would be ignored, so it is refused.
    """
    if "[" in split:
        raise SourceError(
            f"the synthetic source has no splits to slice, got split {split!r}: size it with "
            "data.synthetic.num_train / num_val (or data.max_samples)"
        )
    held_out = split != "train" if held_out is None else held_out
    # make_sample seeds sample i with seed * 1_000_003 + i, so neighbouring seeds never share a
    # sample below a million rows: validation rows are never training rows.
    split_seed = seed + 1 if held_out else seed
    rows = SyntheticRows(shape, num_samples, split_seed, kinds, image_size)
    return Source(rows, f"synthetic [{split}, seed {split_seed}]", trusted=True)


def spec_path(spec: Any) -> str | None:
    """The path of a source spec (a string, or a mapping's ``path``); None for anything else."""
    spec = plain(spec)
    if isinstance(spec, str | Path):
        return str(spec)
    return str(spec["path"]) if isinstance(spec, Mapping) and "path" in spec else None


def located_sources(data: Mapping) -> list[tuple[str, str, str]]:
    """(key, path, ``locate(path)``) of the ``train`` and ``val`` sources a data config names."""
    paths = [(key, spec_path(data.get(key))) for key in ("train", "val")]
    return [(key, path, locate(path)) for key, path in paths if path is not None]


def locate(path: str) -> str:
    """Where a source path's rows come from: ``synthetic``, ``local`` (an existing file or folder),
    ``missing`` (a local path, by its form, that does not exist) or ``hub`` (a dataset name)."""
    if path == "synthetic":
        return "synthetic"
    if Path(path).expanduser().exists():
        return "local"
    return "missing" if _looks_like_path(path) else "hub"


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
        return from_folder(local, spec.get("subset"), split)
    if local.is_file():
        return _from_file(local, split, explicit)
    if locate(path) == "missing":
        raise SourceError(f"no such file or folder: {local.resolve()}")
    return _from_hub(path, spec.get("subset"), split)
