"""Single data files and ``save_to_disk`` folders: a dict spec's ``split`` picks their rows (datasets'
split syntax), and a parquet file with JSON-text columns loads as datasets reads it."""

from __future__ import annotations

import json
import logging
import re

import datasets
import pytest

from lightning_vlm.data import PromptDataModule, SFTDataModule, SourceError, sources


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def prompts(mixed: bool = False) -> list[dict]:
    """Ten prompt rows q0..q9; ``mixed``: a solution column that changes type (read with Python's json)."""
    return [{"prompt": f"q{i}", "solution": i if mixed and i % 2 else f"s{i}"} for i in range(10)]


def write(tmp_path, kind: str) -> str:
    """The ten rows as one source of ``kind``; returns its path."""
    rows = prompts(mixed=kind == "jsonl_mixed")
    if kind.startswith("jsonl"):
        (tmp_path / "all.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return str(tmp_path / "all.jsonl")
    dataset = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        dataset.to_parquet(str(tmp_path / "all.parquet"))
        return str(tmp_path / "all.parquet")
    dataset.save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def texts(dataset) -> list[str]:
    return [dataset[i]["prompt"][0]["content"][0]["text"] for i in range(len(dataset))]


@pytest.mark.parametrize("kind", ["jsonl", "jsonl_mixed", "parquet", "disk"])
def test_a_split_slice_picks_rows_of_a_single_file_or_saved_dataset(tmp_path, kind):
    path = write(tmp_path, kind)
    train, val = {"path": path, "split": "train[:80%]"}, {"path": path, "split": "train[80%:]"}
    dm = PromptDataModule(train=train, val=val, shuffle=False)
    dm.setup()
    assert texts(dm.train_dataset) == [f"q{i}" for i in range(8)]
    assert texts(dm.val_dataset) == ["q8", "q9"]
    assert f"{path} [train[80%:]]" in dm.val_dataset.source.name  # its row numbers count from the slice
    rows = sources.load_source({"path": path, "split": "train[-3:]+train[:1]"}, "prompt").rows
    assert [row["prompt"] for row in rows] == ["q7", "q8", "q9", "q0"]
    # the one split is "train": a plain "train", or the DataModule's default split names, read it all
    dm = PromptDataModule(train=path, val={"path": path, "split": "train"})
    dm.setup()
    assert len(dm.train_dataset) == len(dm.val_dataset) == 10
    assert len(sources.load_source(path, "prompt", "validation").rows) == 10


@pytest.mark.parametrize("split", ["validation", "validation[:50%]", "train[:x]"])
def test_a_split_a_single_file_cannot_honour_is_an_error_naming_it(tmp_path, split):
    path = write(tmp_path, "jsonl")
    where = re.escape(f"{path}: split '{split}' cannot be read")
    with pytest.raises(SourceError, match=rf"{where}.*it has the split\(s\) \['train'\].*train\[:80%\]"):
        PromptDataModule(train={"path": path, "split": split}).setup()


def test_a_split_slice_picks_rows_of_a_saved_dataset_dict(tmp_path):
    dataset = datasets.Dataset.from_list(prompts())
    splits = datasets.DatasetDict({"train": dataset, "validation": dataset.select(range(4))})
    splits.save_to_disk(str(tmp_path / "dict"))
    rows = sources.load_source(
        {"path": str(tmp_path / "dict"), "split": "train[:20%]+validation[-1:]"}, "prompt"
    )
    assert [row["prompt"] for row in rows.rows] == ["q0", "q1", "q3"]
    with pytest.raises(SourceError, match="without split 'test'"):
        sources.load_source({"path": str(tmp_path / "dict"), "split": "test[:10%]"}, "prompt")


def test_a_parquet_file_with_json_text_columns_loads_and_says_so(tmp_path, caplog):
    # datasets' JSON loader stores a field that changes type (a user turn of blocks, an assistant string)
    # as JSON text; to_parquet keeps that type, and the file is parquet, not JSON text to re-read.
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                      {"role": "assistant", "content": answer}]}
        for i, answer in enumerate(["red", "blue"])
    ]  # fmt: skip
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    stored = datasets.load_dataset("json", data_files=str(tmp_path / "mixed.jsonl"), split="train")
    stored.to_parquet(str(tmp_path / "mixed.parquet"))
    dm = SFTDataModule(train=str(tmp_path / "mixed.parquet"), shuffle=False)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        dm.setup()
    answers = [dm.train_dataset[i]["messages"][1]["content"] for i in range(2)]
    assert answers == [[{"type": "text", "text": "red"}], [{"type": "text", "text": "blue"}]]
    assert f"{tmp_path / 'mixed.parquet'}: some field changes type" in caplog.text


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_date_like_answers_stay_the_strings_written(tmp_path, layout):
    # Arrow's JSON reader types a column of ISO dates as timestamps: SFT trained on "2023-01-15 00:00:00",
    # and a GRPO solution became a datetime no answer matched.
    rows = [{"prompt": f"When was receipt {i}?", "solution": f"2023-0{i + 1}-15"} for i in range(3)]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = str(folder / "train.jsonl") if layout == "file" else str(folder)
    dm = PromptDataModule(train=spec, shuffle=False)
    dm.setup()
    assert [dm.train_dataset[i]["solution"] for i in range(3)] == ["2023-01-15", "2023-02-15", "2023-03-15"]
    sft = SFTDataModule(train=spec, shuffle=False, prompt_template="{prompt}", answer_template="{solution}")
    sft.setup()
    assert sft.train_dataset[0]["messages"][1]["content"] == [{"type": "text", "text": "2023-01-15"}]


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_whole_numbers_beside_decimals_stay_whole(tmp_path, layout):
    # Arrow types a column mixing 4 and 4.5 as floats: SFT trained on the answer "4.0"
    rows = [{"prompt": "How many?", "solution": 4}, {"prompt": "How wide?", "solution": 4.5}]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spec = str(folder / "train.jsonl") if layout == "file" else str(folder)
    sft = SFTDataModule(train=spec, shuffle=False, prompt_template="{prompt}", answer_template="{solution}")
    sft.setup()
    answers = [sft.train_dataset[i]["messages"][1]["content"][0]["text"] for i in range(2)]
    assert answers == ["4", "4.5"] and sft.train_dataset[0]["solution"] == 4


def test_a_key_written_twice_in_a_row_is_an_error_naming_the_line(tmp_path):
    # Arrow refused the line, and Python's json, read instead, kept the last value silently
    path = tmp_path / "train.jsonl"
    path.write_text(
        '{"prompt": "q", "solution": "A"}\n{"prompt": "q", "solution": "FIRST", "solution": "SECOND"}\n'
    )
    with pytest.raises(SourceError, match=r"train.jsonl: line 2: the key 'solution' appears twice"):
        PromptDataModule(train=str(path)).setup()


@pytest.mark.parametrize("split", ["validation[:3]", "test[:50%]", "train[:2]+validation"])
def test_a_split_slice_a_single_file_cannot_honour_is_an_error_also_as_the_datamodules_split(tmp_path, split):
    # Given as data.split / data.val_split (not a dict spec), it read the whole file, saying nothing.
    path = write(tmp_path, "jsonl")
    with pytest.raises(SourceError, match=re.escape(f"{path}: split '{split}' cannot be read")):
        PromptDataModule(train=path, split=split).setup()
    with pytest.raises(SourceError, match=re.escape(f"{path}: split '{split}' cannot be read")):
        PromptDataModule(train=path, val=path, val_split=split).setup()


def test_image_paths_in_a_column_no_image_setting_reads_are_named(tmp_path, caplog):
    # Images under "image_path" (not "image"/"images"): every row trained text-only, with no word.
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    row = {"prompt": "What colour is the car?", "solution": "red", "image_path": "a.png"}
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for _ in range(3)))
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        PromptDataModule(train=str(tmp_path / "train.jsonl")).setup()
    assert "no row has an image" in caplog.text and "'image_path'" in caplog.text
    assert "data.column_map" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        PromptDataModule(train=str(tmp_path / "train.jsonl"), column_map={"image_path": "image"}).setup()
    assert "no row has an image" not in caplog.text


def test_the_rows_a_run_trains_on_are_logged(tmp_path, caplog):
    # only skips were logged: a column map or a template that dropped rows showed nowhere
    with caplog.at_level(logging.INFO, logger="lightning_vlm.data"):
        PromptDataModule(train=write(tmp_path, "jsonl"), val_fraction=0.2).setup()
    assert any(
        re.fullmatch(
            r"Data: 8 training rows from .*\.jsonl; 2 validation rows from .*\.jsonl", r.getMessage()
        )
        for r in caplog.records
    )
