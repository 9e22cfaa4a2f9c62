"""Plain folders of data files (``train.jsonl``, ``validation.jsonl``, ``data/train-*.parquet``) as a
source: ``datasets`` infers the builder and the splits from the file names, and we read JSON files as
written where its JSON text would change them. Relative image paths start beside each row's own data
file, as for that file given alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from lightning_vlm.data.files import (
    ARCHIVE_ERRORS,
    FILE_BUILDERS,
    SourceError,
    data_suffix,
    has_guessed_feature,
    has_json_feature,
    is_compressed,
    is_utf8,
    json_problem,
    json_rows_readable,
    load_file,
    parquet_problem,
    read_json_rows,
    whole_file_problem,
)
from lightning_vlm.data.images import IMAGE_SUFFIXES
from lightning_vlm.data.loaded import DatasetRows, Source, load_hf_dataset, logger, warn_json_text
from lightning_vlm.data.splits import pick_rows, row_dirs, split_names


def from_folder(folder: Path, subset: str | None, split: str) -> Source:
    """A plain folder of data files: the datasets library infers the builder and the splits from the
    file names (``train.jsonl``, ``validation.jsonl``, ...). Relative image paths start beside each
    row's data file, as for a file given alone (``data/train.jsonl`` next to ``data/a.png``)."""
    name = f"{folder} [{split}]"
    found = _data_files(folder, subset)
    named = _folder_files(found, split)
    if found is not None:
        _check_type(folder, *found)
    if named is not None:
        _check_left_out(folder, subset, named, found[0])
        json_files = [f for f in _json_files(named) if not _archive_by_content(f)]
        # datasets reads a non-UTF-8 JSON file without a word, and fails at the first row read
        _raise_file_problem([f for f in json_files if not is_utf8(f)])
        # and takes a key twice or a NaN without a word in a file it reads whole
        _raise_file_problem(json_files, whole_file_problem)
    try:
        dataset = load_hf_dataset(str(folder), subset, split, folder=True)
    except SourceError:
        if named is None:
            raise
        _raise_file_problem(_files(named))  # the file and line, not datasets' generic words
        if not _json_as_written(named):
            raise
        # datasets' JSON reader fails on some files Python's json reads row by row (a field that
        # changes type, beside a blank line): read those as written.
        return _rows_as_written(folder, named, _spelt(split, named), name, None)
    _check_builder(folder, named)
    as_written = named is not None and _json_as_written(named)
    # JSON text of mixed-type fields, or guessed types: dates, floats (files.has_guessed_feature).
    if has_json_feature(dataset.features) or (as_written and has_guessed_feature(dataset.features)):
        if as_written:
            try:
                return _rows_as_written(folder, named, _spelt(split, named), name, len(dataset))
            except (ValueError, *ARCHIVE_ERRORS) as e:  # a file datasets read by its content, not its name
                logger.warning("%s: could not re-read %s with Python's json (%s)", name, list(named), e)
        warn_json_text(name)  # a zip or zstd archive, or a spec we do not follow: datasets' rows, said so
    if named is None:
        return Source(DatasetRows(dataset), name, folder)
    parents = {f.parent for f in _files(named)}
    if len(parents) == 1:
        return Source(DatasetRows(dataset), name, parents.pop())
    if not all(data_suffix(f) in FILE_BUILDERS for f in _files(named)):
        # Files of an image folder (datasets resolves their paths itself) or another builder's.
        return Source(DatasetRows(dataset), name, folder)
    counts = {f: len(load_file(f)) for f in _files(named)}
    dirs = row_dirs(named, counts, _spelt(split, named), name)
    _check_rows(name, folder, len(dataset), len(dirs))
    return Source(DatasetRows(dataset), name, folder, row_dirs=dirs)


_MEDIA = {*IMAGE_SUFFIXES, ".wav", ".mp3", ".flac"}


def _check_builder(folder: Path, named: Mapping[str, list[Path]] | None) -> None:
    """Refuse a folder that datasets reads as an image (or audio) folder though it holds data files: it
    infers one builder per folder, the most common file type, so images under folders named like
    splits (COCO's ``images/train2014``) take the split and the JSONL beside them is ignored."""
    if named is None or not all(f.suffix.lower() in _MEDIA for f in _files(named)):
        return
    ignored = sorted(
        p for p in folder.rglob("*")
        if p.is_file() and data_suffix(p) in FILE_BUILDERS and not p.name.startswith("metadata.")
    )  # fmt: skip
    if ignored:
        shown = ", ".join(str(p.relative_to(folder)) for p in ignored[:3])
        raise SourceError(
            f"{folder}: datasets reads it as an image folder (its split's files are {_files(named)[0].suffix} "
            f"files, e.g. images under a folder named like a split) and ignores its data files ({shown}"
            f"{', ...' if len(ignored) > 3 else ''}); give the data file itself, e.g. data.train={ignored[0]}"
        )


# Types datasets reads rows from as tables, by data suffix: it reads one per folder, and leaves the others
# out. Of these only json and parquet are ours to read (FILE_BUILDERS; see _check_type).
_TABLES = {**FILE_BUILDERS, ".ndjson": "json", ".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}


def _check_type(folder: Path, builder: str, files: Mapping[str, list[Path]]) -> None:
    """Refuse a folder datasets reads with a builder other than the ones a file given alone is read with:
    its csv reader guesses each column's type, so answers 02134, 4.50 and NA trained as '2134.0', '4.5'
    and a skipped row. Image and audio folders are ``_check_builder``'s."""
    if builder in FILE_BUILDERS.values() or builder.endswith("folder"):
        return
    read = [f for split_files in files.values() for f in split_files]
    raise SourceError(
        f"{folder}: datasets reads its data files ({_names(folder, read)}) with its {builder!r} reader, "
        f"an unsupported file type, as such a file given alone is; convert them to one of "
        f"{sorted(FILE_BUILDERS)} (JSON ones may be compressed: .gz, .bz2, .xz)"
    )


def _check_left_out(folder: Path, subset: str | None, named: Mapping[str, list[Path]], builder: str) -> None:
    """Refuse a split whose files are of several data types: datasets reads one type per folder (the
    most common, ``builder``) and leaves the other files out without a word, so their rows were never
    trained on."""
    if subset is not None or _card_names_files(folder):  # a dataset card's configs name the files
        return
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        matched = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # datasets raises many types; the folder's load says the rest
        return
    for split, files in named.items():
        # data files of a builder other than the one read (None: not a data file)
        left = sorted(
            Path(f)
            for f in matched.get(split, [])
            if _TABLES.get(data_suffix(Path(f))) not in {None, builder}
        )
        if left:
            types = sorted({data_suffix(f) for f in [*files, *left]})
            raise SourceError(
                f"{folder}: split '{split}' has data files of several types ({', '.join(types)}); datasets "
                f"reads one type per folder, {_names(folder, files)}, and would leave out "
                f"{_names(folder, left)}: convert them to one type of {sorted(FILE_BUILDERS)}, or give each "
                "type a folder of its own"
            )


def _card_names_files(folder: Path) -> bool:
    """Whether the folder's dataset card (README.md's YAML header) lists ``configs``, which name the files
    each config reads: other files (another config's) are left out on purpose."""
    card = folder / "README.md"
    if not card.is_file():
        return False
    header = card.read_text(errors="replace").split("\n---", 1)[0]
    return header.startswith("---") and any(line.startswith("configs:") for line in header.splitlines())


def _names(folder: Path, files: list[Path]) -> str:
    return ", ".join(str(f.relative_to(folder)) for f in files[:3]) + (", ..." if len(files) > 3 else "")


def _raise_file_problem(files: list[Path], json_check: Callable[[Path], str | None] = json_problem) -> None:
    """SourceError naming the first of these data files that is not loadable and what is wrong there."""
    problems = {"json": json_check, "parquet": parquet_problem}
    for f in files:
        check = problems.get(FILE_BUILDERS.get(data_suffix(f), ""))
        if check is not None and (problem := check(f)) is not None:
            raise SourceError(f"{f}: {problem}")


# gzip, bzip2, xz, zstd, zip: datasets opens an archive by its first bytes, whatever its name says
_ARCHIVE_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"(\xb5/\xfd", b"PK\x03\x04")


def _archive_by_content(path: Path) -> bool:
    """An archive whose name does not say so (``train.jsonl`` holding gzip): datasets reads it."""
    with path.open("rb") as f:
        return not is_compressed(path) and f.read(6).startswith(_ARCHIVE_MAGIC)


def _json_files(named: Mapping[str, list[Path]]) -> list[Path]:
    return [f for f in _files(named) if FILE_BUILDERS.get(data_suffix(f)) == "json"]


def _data_files(folder: Path, subset: str | None) -> tuple[str, dict[str, list[Path]]] | None:
    """The builder datasets reads a plain folder with (``json``, ``csv``, ``imagefolder``, ...) and the
    data files of each split, in its order (the order "all" reads them in); None for a folder whose files
    datasets does not name."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(str(folder), name=subset)
    except Exception:  # datasets raises many types; the folder's load (or its error) says the rest
        return None
    return builder.name, {str(s): [Path(f) for f in files] for s, files in builder.config.data_files.items()}


def _folder_files(
    found: tuple[str, dict[str, list[Path]]] | None, split: str
) -> dict[str, list[Path]] | None:
    """The data files of each split that ``split`` reads of those ``_data_files`` found; None for a spec we
    do not follow (one naming a split they do not give) or a folder whose files datasets does not name."""
    if found is None:
        return None
    named = found[1]
    wanted = set(named) if split == "all" else split_names(split)
    if wanted - set(named):
        return None
    return {s: files for s, files in named.items() if s in wanted}


def _spelt(split: str, named: Mapping[str, list[Path]]) -> str:
    """``split`` with "all" spelt out as datasets reads it: every split, in order."""
    return "+".join(named) if split == "all" else split


def _files(named: Mapping[str, list[Path]]) -> list[Path]:
    return [f for files in named.values() for f in files]


def _json_as_written(named: Mapping[str, list[Path]]) -> bool:
    """Whether Python's json reads all these files (not a zip or zstd archive)."""
    return all(json_rows_readable(f) for f in _files(named))


def _rows_as_written(
    folder: Path, named: Mapping[str, list[Path]], split: str, name: str, expected: int | None
) -> Source:
    """The rows ``split`` reads from a folder's JSON files as Python's json reads them (held in memory),
    each with the folder of its file; ``expected``: how many rows datasets read, if it read them."""
    per_file = {f: read_json_rows(f) for f in _files(named)}
    read = {s: [row for f in files for row in per_file[f]] for s, files in named.items()}
    rows = [
        read[s][i]
        for s, indices in pick_rows(split, {s: len(r) for s, r in read.items()}, name)
        for i in indices
    ]
    if expected is not None:
        _check_rows(name, folder, expected, len(rows))
    dirs = row_dirs(named, {f: len(r) for f, r in per_file.items()}, split, name)
    return Source(rows, name, folder, row_dirs=dirs)


def _check_rows(name: str, folder: Path, by_datasets: int, by_files: int) -> None:
    """The files we read must be the ones datasets read: never guess which row is which."""
    if by_datasets != by_files:
        raise SourceError(
            f"{name}: datasets read {by_datasets} rows from {folder}, the split's files one by one "
            f"{by_files}; pass the split's files one at a time to find the one that differs"
        )
