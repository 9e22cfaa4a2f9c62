"""Local data files (``.json``/``.jsonl``, plain or gzip/bz2/xz-compressed, and ``.parquet``) loaded with
``datasets``, and its failures explained.

``datasets``' loaders fail on a bad file with whatever their parser raised: a bare ``StopIteration``
for an empty file, "An error occurred while generating the dataset" for one bad JSON line, a
``UnicodeDecodeError`` with an offset inside some buffer for non-UTF-8 bytes (and only once rows are
read: Arrow's JSON reader stores them unchecked). So a JSON file is first checked to be UTF-8 (one
streamed decode, about a second per GB), and only when that or the load fails do we parse the file
ourselves to say what is wrong where (file, line, column, byte offset), as a :class:`SourceError`
raised before training starts. A file with a key twice in an object, or the non-JSON NaN / Infinity,
is refused naming the line, wherever ``datasets``' own readers would have taken them.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import lzma
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

FILE_BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Compressions of JSON data that datasets reads and the standard library streams (train.jsonl.gz).
_OPENERS: dict[str, Callable[..., BinaryIO]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# What a damaged archive raises while it is read.
ARCHIVE_ERRORS = (OSError, EOFError, lzma.LZMAError)
_SNIPPET = 60  # characters of a bad line shown in the message
_CHUNK = 1 << 24  # bytes per read of the UTF-8 check


class SourceError(RuntimeError):
    """A source could not be found or loaded; the message says which and what to try instead."""


class JsonOnlyPythonReads(SourceError):
    """A JSON file every line of which Python's json reads, that ``datasets`` still cannot load (a
    field changing type beside a blank line): a reader of rows as written can take it from here."""


def _snippet(text: str) -> str:
    return repr(text if len(text) <= _SNIPPET else text[:_SNIPPET] + "...")


def _utf8_problem(data: bytes) -> str | None:
    """Where the first non-UTF-8 bytes are (byte offset, line, column), or None if it all decodes."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        bad = data[e.start : e.end]
        return (
            f"not UTF-8: byte offset {e.start} (line {line}, byte {e.start - line_start + 1} of the line) "
            f"holds {bad!r} ({e.reason}); JSON data files must be UTF-8: re-save the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8` if it is Latin-1"
        )
    return None


def data_suffix(path: Path) -> str:
    """The suffix that says what ``path`` holds: ``.jsonl`` for ``train.jsonl`` and ``train.jsonl.gz``."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if len(suffixes) == 2 and suffixes[-1] in _OPENERS:
        return suffixes[0]
    return suffixes[-1] if suffixes else ""


def is_compressed(path: Path) -> bool:
    """Whether ``path``'s name says it is compressed in a way :func:`open_data` undoes."""
    return path.suffix.lower() in _OPENERS


def open_data(path: Path) -> BinaryIO:
    """``path`` opened for reading its data bytes, decompressed where its name says it is compressed."""
    return _OPENERS.get(path.suffix.lower(), Path.open)(path, "rb")


def json_rows_readable(path: Path) -> bool:
    """Whether :func:`read_json_rows` reads ``path``: a .json/.jsonl file, maybe gzip/bz2/xz-compressed
    (a zip or zstd archive's data suffix is its own)."""
    return data_suffix(path) in (".json", ".jsonl")


def is_utf8(path: Path) -> bool:
    """Whether the whole file decodes as UTF-8, read in chunks (a multi-GB file is never held whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open_data(path) as f:
            while chunk := f.read(_CHUNK):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


class DuplicateKeyError(ValueError):
    """A JSON object with one key twice: Python's json keeps the last value, Arrow refuses the row."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise DuplicateKeyError(f"the key {twice!r} appears twice in one object (which value is meant?)")
    return dict(pairs)


class NotJsonError(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: Python's json reads them as floats (and writes a float NaN
    so), but they are not JSON; a template then trained the text "nan" as an answer."""


def _no_constant(name: str) -> NoReturn:
    raise NotJsonError(
        f"{name} is not a JSON value (Python's json.dumps writes a float NaN or infinity so): write null "
        "for a missing value, or the number as a string"
    )


# A JSON string (skipped: it may hold the word) or one of the constants json.loads would read.
_CONSTANT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _constant_at(text: str) -> tuple[int, int]:
    """(line, column) of the first NaN or Infinity outside a string of ``text``: json.loads hands its
    ``parse_constant`` the word only."""
    found = next((m for m in _CONSTANT.finditer(text) if m.group(1)), None)
    start = found.start(1) if found is not None else 0
    return text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start)


def _loads(text: str) -> Any:
    """``json.loads`` that refuses an object holding a key twice (:class:`DuplicateKeyError`) and the
    non-JSON constants NaN and Infinity (:class:`NotJsonError`)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _json_lines_problem(text: str) -> str | None:
    """The first line of a JSON Lines text that is not one JSON object, or None if every line is."""
    rows = 0
    for number, line in enumerate(json_lines(text), start=1):
        if not line.strip():
            continue  # blank lines are allowed (and skipped) by the loader
        try:
            row = _loads(line)
        except json.JSONDecodeError as e:
            return f"line {number}, column {e.colno}: invalid JSON ({e.msg}): {_snippet(line)}"
        except DuplicateKeyError as e:
            return f"line {number}: {e}: {_snippet(line)}"
        except NotJsonError as e:
            return f"line {number}, column {_constant_at(line)[1]}: {e}: {_snippet(line)}"
        if not isinstance(row, dict):
            return (
                f"line {number} is a JSON {type(row).__name__}, not an object: JSON Lines data holds one "
                f"row (an object of columns) per line"
            )
        rows += 1
    return (
        None
        if rows
        else "the file has no rows (only blank lines); a JSON Lines file holds one object per line"
    )


def _json_document_problem(text: str) -> str | None:
    """What is wrong with a whole-file JSON document (a list of row objects), or None."""
    try:
        data = _loads(text)
    except json.JSONDecodeError as e:
        return f"line {e.lineno}, column {e.colno}: invalid JSON ({e.msg})"
    except DuplicateKeyError as e:
        return str(e)
    except NotJsonError as e:
        line, column = _constant_at(text)
        return f"line {line}, column {column}: {e}"
    if isinstance(data, list):
        if not data:
            return "the file has no rows (an empty JSON list)"
        bad = next((i for i, row in enumerate(data) if not isinstance(row, dict)), None)
        if bad is not None:
            return f"item {bad} of the JSON list is a {type(data[bad]).__name__}, not a row object"
    return None


def json_problem(path: Path) -> str | None:
    """What makes ``path`` unloadable as JSON/JSON Lines data, or None if we find nothing wrong."""
    with open_data(path) as f:
        data = f.read()
    if not data.strip():
        size = (
            "only whitespace" if data else "0 bytes once decompressed" if is_compressed(path) else "0 bytes"
        )
        return f"the file is empty ({size}): it holds no rows"
    problem = _utf8_problem(data)
    if problem:
        return problem
    text = data.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is not the data's fault
    # `datasets` reads .json files as JSON Lines too (one object per line), and .jsonl files that hold
    # a single JSON list: judge the file by what it looks like, not by its name.
    if text.lstrip().startswith("["):
        return _json_document_problem(text)
    return _json_lines_problem(text)


def _read_whole(path: Path) -> bool:
    """Whether ``datasets`` may read this JSON file whole, by a parser that checks less than ours: a JSON
    list (ujson: NaN as null, a key twice its last value), or a single line, which its fallback, pandas,
    reads as one object of columns (a key twice: its last value; a list: one row per item)."""
    rows = 0
    with open_data(path) as f:
        for line in f:  # a file of many lines is read no further than its second row
            line = line.removeprefix(codecs.BOM_UTF8).strip()
            if line.startswith(b"[") and not rows:
                return True
            rows += bool(line)
            if rows > 1:
                return False
    return True


def whole_file_problem(path: Path) -> str | None:
    """What :func:`json_problem` finds in a JSON file ``datasets`` may read whole (``_read_whole``): its
    readers take a key twice or a NaN there without a word. Other files, Arrow reads line by line: it
    refuses a key twice, and a NaN comes back a float, which has the file re-read as written."""
    return json_problem(path) if _read_whole(path) else None


def _innermost(error: BaseException) -> BaseException:
    """The root cause of a chained exception: the parser's own message, not the loader's wrapper."""
    seen = {id(error)}
    while (cause := error.__cause__ or error.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        error = cause
    return error


def load_file(path: Path) -> Any:
    """``path`` as a ``datasets.Dataset`` (one split, whatever its name); a bad file raises SourceError
    naming the file and, for JSON, the line (or byte offset) and what is wrong there."""
    import datasets

    builder = FILE_BUILDERS.get(data_suffix(path))
    compressed = is_compressed(path)
    if builder is None or (compressed and builder != "json"):
        kind = "".join(path.suffixes[-2:]) if compressed else path.suffix
        raise SourceError(
            f"{path}: unsupported file type {kind!r}; use one of {sorted(FILE_BUILDERS)} (JSON ones may be "
            f"compressed: {', '.join(_OPENERS)})"
        )
    if path.stat().st_size == 0:  # datasets raises a bare StopIteration for this
        raise SourceError(f"{path}: the file is empty (0 bytes): it holds no rows")
    try:
        if builder == "json" and not is_utf8(path):
            raise SourceError(f"{path}: {json_problem(path)}")
        if builder == "json" and (problem := whole_file_problem(path)) is not None:
            raise SourceError(f"{path}: {problem}")
    except ARCHIVE_ERRORS as e:  # checked first: datasets' own message names neither file nor cause
        if not compressed:  # a plain file's OSError (permissions, ...) says what it is
            raise
        raise SourceError(f"{path}: not a readable {path.suffix} archive: {type(e).__name__}: {e}") from e
    try:
        # A local file is one split, "train", whatever its name (so a separate validation file just
        # works); sources picks a split spec's rows of it (splits.one_split, splits.pick_rows).
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # the loaders raise many types (ArrowInvalid, StopIteration, ...)
        problem = json_problem(path) if builder == "json" else parquet_problem(path)
        if problem is not None:
            raise SourceError(f"{path}: {problem}") from e
        root = _innermost(e)  # nothing we can pin down: the parser's own words, with the file
        error = JsonOnlyPythonReads if builder == "json" else SourceError
        raise error(f"{path}: could not be read as {builder} data: {type(root).__name__}: {root}") from e


def parquet_problem(path: Path) -> str | None:
    """What we can name about a parquet file datasets failed on: one with a schema and no rows (its
    reader says "BatchSize must be greater than 0")."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_metadata(path).num_rows
    except Exception:  # not parquet at all: the reader's own words say more
        return None
    return "the file holds no rows (a schema only)" if rows == 0 else None


def has_json_feature(feature: Any) -> bool:
    """Whether ``datasets`` stored some field of ``feature`` as JSON text: what its JSON loader does
    with a field whose type changes between rows (a message's content: a list of blocks in the user
    turn, a string in the assistant's)."""
    import datasets

    if isinstance(feature, datasets.Json):
        return True
    if isinstance(feature, dict):
        return any(has_json_feature(f) for f in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and has_json_feature(inner)


# Types Arrow's JSON reader guesses: ISO dates ("2023-01-15") come back as datetimes ("2023-01-15 00:00:00"
# as text), and a column mixing whole numbers with decimals makes every number a float (4 -> 4.0, an
# answer "4.0" in a template).
_GUESSED_TYPES = ("timestamp", "date", "time", "duration", "float", "double")


def has_guessed_feature(feature: Any) -> bool:
    """Whether ``datasets`` typed some field of ``feature`` by a guess that changes values as written: a
    date or time, or a float (see ``_GUESSED_TYPES``). Only a JSON file's reading is a guess; a parquet
    file's types are its own."""
    import datasets

    if isinstance(feature, datasets.Value):
        return feature.dtype.startswith(_GUESSED_TYPES)
    if isinstance(feature, dict):
        return any(has_guessed_feature(f) for f in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and has_guessed_feature(inner)


def read_json_rows(path: Path) -> list[dict]:
    """The rows of a JSON Lines file (or a JSON list of row objects), exactly as Python's json reads them.

    For files whose fields change type between rows: ``datasets`` (5.2) keeps a string that happens to
    be valid JSON as JSON text, so an answer "4" comes back as the number 4 and "[0.1, 0.2, 0.5, 0.6]"
    as a list. Call ``json_problem`` first (or load it with ``datasets``): this assumes a readable file.
    """
    with open_data(path) as f:
        text = f.read().decode("utf-8").removeprefix("\ufeff")
    try:
        if text.lstrip().startswith("["):
            return _loads(text)
        return [_loads(line) for line in json_lines(text) if line.strip()]
    except (DuplicateKeyError, NotJsonError) as e:  # datasets read them (Arrow: NaN as a float): say where
        raise SourceError(f"{path}: {json_problem(path) or e}") from e


def json_lines(text: str) -> list[str]:
    """The lines of JSON Lines text as Arrow splits them: at "\n" only (JSON strings may hold U+2028,
    U+2029 or U+0085 unescaped, which ``str.splitlines`` would split at), each without its "\r"."""
    return [line.removesuffix("\r") for line in text.split("\n")]
