"""Data files that loaded and trained wrongly without a word (a reviewer's finds), each now refused before
training naming the file and, for JSON, the line: NaN and Infinity (not JSON, read by Python's json as
floats: an answer trained as the text "nan"), a key twice on a one-line file (datasets' fallback, pandas,
took it, and split a list value into rows), and CSV files in a folder (pandas' type guesses: an answer
02134 trained as '2134.0'; beside a JSONL, left out)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import datasets
import pytest
from PIL import Image

from lightning_vlm.data import PromptDataModule, SFTDataModule, SourceError


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet/csv builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


TEMPLATES = {"prompt_template": "{question}", "answer_template": "{answer}"}
GOOD = '{"question": "What colour?", "answer": "red", "image": "a.png"}'
NAN = '{"question": "What colour?", "answer": NaN, "image": "a.png"}'
NOT_JSON = "is not a JSON value"

# case: (file name, its text, what the error names after the file)
# fmt: off
CONSTANTS: dict[str, tuple[str, str, str]] = {
    # the reviewer's row: one line, its answer trained as "nan"
    "nan_one_line": ("data.jsonl", NAN + "\n", f"line 1, column 40: NaN {NOT_JSON}"),
    # Arrow reads NaN as a float: the file is re-read as written, which failed nothing
    "nan_after_a_good_line": ("data.jsonl", f"{GOOD}\n{NAN}\n", f"line 2, column 40: NaN {NOT_JSON}"),
    # after an answer that is a string: datasets' JSON text for the column, NaN within
    "infinity_beside_text": ("data.jsonl", GOOD + "\n" + NAN.replace("NaN", "Infinity"),
                             f"line 2, column 40: Infinity {NOT_JSON}"),
    "minus_infinity_nested": ("data.jsonl", f'{GOOD}\n{GOOD[:-1]}, "meta": {{"score": -Infinity}}}}\n',
                              f"line 2, column 83: -Infinity {NOT_JSON}"),
    # a JSON list: datasets' ujson read NaN as null
    "nan_in_a_json_list": ("data.json", f"[\n  {GOOD},\n  {NAN}\n]", f"line 3, column 42: NaN {NOT_JSON}"),
    "nan_gzipped": ("data.jsonl.gz", NAN, f"line 1, column 40: NaN {NOT_JSON}"),
}
# fmt: on


def write(folder: Path, name: str, text: str) -> Path:
    """``text`` as the file ``name`` (gzip-compressed for .gz) beside an a.png."""
    import gzip

    Image.new("RGB", (8, 8), (255, 0, 0)).save(folder / "a.png")
    data = text.encode()
    (folder / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return folder / name


@pytest.mark.parametrize("case", list(CONSTANTS))
def test_nan_or_infinity_in_a_json_file_is_refused_naming_the_line(tmp_path, case):
    name, text, where = CONSTANTS[case]
    path = write(tmp_path, name, text)
    with pytest.raises(SourceError, match="write null for a missing value") as info:
        SFTDataModule(train=str(path), **TEMPLATES).setup()
    assert f"{path}: {where}" in str(info.value)


@pytest.mark.parametrize("name", ["train.jsonl", "train.json"])
def test_nan_in_a_folders_file_is_refused_naming_the_file_and_line(tmp_path, name):
    folder = tmp_path / "data"
    folder.mkdir()
    text, line = (f"[\n{GOOD},\n{NAN}\n]", 3) if name.endswith(".json") else (f"{GOOD}\n{NAN}\n", 2)
    write(folder, name, text)
    with pytest.raises(SourceError, match=rf"{folder / name}: line {line}, column 40: NaN {NOT_JSON}"):
        SFTDataModule(train=str(folder), val_fraction=None, **TEMPLATES).setup()


def test_the_word_nan_in_a_string_is_text(tmp_path):
    # Only the bare constant is refused: "NaN" written as a string is an answer like any other.
    path = write(tmp_path, "data.jsonl", NAN.replace("NaN", '"NaN"') + "\n" + GOOD.replace("red", "Infinity"))
    dm = SFTDataModule(train=str(path), shuffle=False, **TEMPLATES)
    dm.setup()
    answers = [dm.train_dataset[i]["messages"][1]["content"][0]["text"] for i in range(2)]
    assert answers == ["NaN", "Infinity"]


DUPLICATE = '{"prompt": ["q1", "q2"], "solution": "1", "solution": "2"}'


@pytest.mark.parametrize("where", ["file", "folder", "file_with_blank_lines", "json_list"])
def test_a_key_twice_on_a_one_line_file_is_refused_naming_the_line(tmp_path, where):
    # datasets' Arrow reader refuses the line, and its fallback, pandas, read the one-line file as an
    # object of columns: 2 rows, prompts q1 and q2, both with the solution "2".
    text = {"file_with_blank_lines": f"\n{DUPLICATE}\n\n", "json_list": f"[{DUPLICATE}]"}.get(
        where, DUPLICATE
    )
    name = "train.json" if where == "json_list" else "train.jsonl"
    (tmp_path / "data").mkdir()
    path = write(tmp_path / "data", name, text)
    line = {"file_with_blank_lines": "line 2: ", "json_list": ""}.get(where, "line 1: ")
    with pytest.raises(SourceError, match=rf"{name}: {line}the key 'solution' appears twice"):
        PromptDataModule(train=str(path.parent if where == "folder" else path)).setup()


def test_a_one_line_file_of_one_row_still_loads(tmp_path):
    # The whole-file check reads a one-line file once more, and finds nothing wrong with a good one.
    path = write(tmp_path, "data.jsonl", '{"prompt": "q1", "solution": "1"}')
    dm = PromptDataModule(train=str(path))
    dm.setup()
    assert len(dm.train_dataset) == 1 and dm.train_dataset[0]["solution"] == "1"


CSV = "question,answer,image\nWhat number?,02134,a.png\nHow much?,4.50,a.png\nWhich?,NA,a.png\n"


def csv_folder(tmp_path: Path, *files: str) -> Path:
    """A folder holding these files, each of the three CSV rows (as JSON Lines for .jsonl, zipped for .zip)."""
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    for name in files:
        if name.endswith(".jsonl"):
            lines = [
                dict(zip(("question", "answer", "image"), r.split(","), strict=True))
                for r in CSV.splitlines()[1:]
            ]
            (folder / name).write_text("\n".join(json.dumps(r) for r in lines))
        elif name.endswith(".zip"):
            with zipfile.ZipFile(folder / name, "w") as z:
                z.writestr("train.csv", CSV)
        else:
            (folder / name).write_text(CSV)
    return folder


@pytest.mark.parametrize(
    "files", [["train.csv"], ["train.tsv"], ["train.zip"], ["train.csv", "validation.csv"]]
)
def test_a_folder_of_csv_files_is_refused_as_a_csv_file_is(tmp_path, files):
    # The csv reader guessed each column's type: answers 02134, 4.50, NA trained as '2134.0', '4.5' and
    # a skipped row (a .csv given alone is refused: tests/test_bad_input_data.py's csv_file).
    folder = csv_folder(tmp_path, *files)
    with pytest.raises(
        SourceError, match=rf"{folder}: datasets reads its data files \({files[0]}.*'csv' reader"
    ):
        SFTDataModule(train=str(folder), **TEMPLATES).setup()


def test_a_csv_file_beside_the_jsonl_a_folder_reads_is_named_as_left_out(tmp_path):
    # datasets read the JSONL (one type per folder) and dropped the CSV's rows without a word.
    folder = csv_folder(tmp_path, "train.jsonl", "train.csv")
    with pytest.raises(SourceError, match=r"split 'train' has data files of several types \(\.csv, \.jsonl\)"
                       r".* train\.jsonl, and would leave out train\.csv"):  # fmt: skip
        SFTDataModule(train=str(folder), **TEMPLATES).setup()
    (folder / "train.csv").unlink()  # the JSONL alone: its answers as written
    dm = SFTDataModule(train=str(folder), shuffle=False, val_fraction=None, **TEMPLATES)
    dm.setup()
    answers = [dm.train_dataset[i]["messages"][1]["content"][0]["text"] for i in range(3)]
    assert answers == ["02134", "4.50", "NA"]
