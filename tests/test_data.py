"""DataModules: every shape from every local source kind and from synthetic; validation errors and skips."""

from __future__ import annotations

import gzip
import json
import logging
import lzma
import zipfile

import datasets
import numpy as np
import pytest
from PIL import Image

from lightning_vlm.data import (
    PreferenceDataModule,
    PromptDataModule,
    RowError,
    SFTDataModule,
    SourceError,
    normalize_row,
    sources,
)

MODULES = {"sft": SFTDataModule, "preference": PreferenceDataModule, "prompt": PromptDataModule}
COLORS = {"red.png": (255, 0, 0), "green.png": (0, 255, 0), "blue.png": (0, 0, 255)}
SMALL = {"num_train": 6, "num_val": 4, "image_size": 32}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def folder(tmp_path):
    """A data folder with three small PNGs under img/."""
    (tmp_path / "img").mkdir()
    for name, color in COLORS.items():
        Image.new("RGB", (8, 8), color).save(tmp_path / "img" / name)
    return tmp_path


IMG = {"type": "image"}
user = lambda *blocks: [{"role": "user", "content": list(blocks)}]  # noqa: E731
text = lambda s: {"type": "text", "text": s}  # noqa: E731


def answered(answer: str, image: str | None = None) -> dict:
    """An SFT row: a question (after ``image``, when given) and an assistant ``answer`` as a plain string."""
    blocks = [IMG, text("Q?")] if image else [text("Q?")]
    return {
        "messages": user(*blocks) + [{"role": "assistant", "content": answer}],
        **({"images": [image]} if image else {}),
    }


def good_rows(shape: str) -> list[dict]:
    """Three raw rows of a shape, in TRL's forms, with image paths relative to the data folder."""
    answer = [{"role": "assistant", "content": [text("red")]}]
    if shape == "sft":
        make = lambda i, q: {"messages": user(IMG, text(q)) + answer}  # noqa: E731
    elif shape == "preference":
        make = lambda i, q: {  # noqa: E731
            "prompt": user(IMG, text(q)),
            "chosen": answer,
            "rejected": [{"role": "assistant", "content": [text("blue")]}],
        }
    else:
        make = lambda i, q: {"prompt": user(IMG, text(q)), "solution": f"s{i}"}  # noqa: E731
    rows = [make(i, f"question {i}?") for i in range(3)]
    rows[0]["images"] = ["img/red.png"]
    rows[1]["image"] = "img/green.png"  # the single-image column
    rows[2]["images"] = ["img/blue.png"]
    return rows


def write(folder, kind: str, rows: list[dict]) -> str:
    """Write rows as a source of one kind; returns the spec to give the DataModule."""
    if kind == "jsonl":
        (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return str(folder / "data.jsonl")
    if kind == "json":
        (folder / "data.json").write_text(json.dumps(rows))
        return str(folder / "data.json")
    if kind == "jsonl.xz":
        (folder / "data.jsonl.xz").write_bytes(lzma.compress("\n".join(json.dumps(r) for r in rows).encode()))
        return str(folder / "data.jsonl.xz")
    if kind == "parquet":
        # from_list takes its columns from the first row; fill the rest with None like stored data.
        keys = dict.fromkeys(k for r in rows for k in r)
        rows = [{k: r.get(k) for k in keys} for r in rows]
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data.parquet"))
        return str(folder / "data.parquet")
    # save_to_disk with the images decoded into an Image feature, as `datasets` users have them.
    decoded = []
    for r in rows:
        refs = r.get("images") or [r["image"]]
        r = {k: v for k, v in r.items() if k not in ("image", "images")}
        decoded.append({**r, "images": [Image.open(folder / p).convert("RGB") for p in refs]})
    ds = datasets.Dataset.from_list(decoded).cast_column("images", datasets.List(datasets.Image()))
    if kind == "disk":
        ds.save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(str(folder / "dict"))
    return str(folder / "dict")


def pixel(image: Image.Image) -> tuple:
    return image.getpixel((4, 4))


def all_rows(dm) -> list[dict]:
    return [row for batch in dm.train_dataloader() for row in batch]


@pytest.mark.parametrize("shape", list(MODULES))
def test_synthetic_batches_are_lists_of_normalised_rows(shape):
    dm = MODULES[shape](batch_size=4, synthetic=SMALL)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, list) and len(batch) == 4
    row = batch[0]
    assert [im.mode for im in row["images"]] == ["RGB"] and row["images"][0].size == (32, 32)
    required = {
        "sft": ["messages"],
        "preference": ["prompt", "chosen", "rejected"],
        "prompt": ["prompt", "solution"],
    }
    assert set(required[shape]) <= set(row)
    assert len(dm.val_dataset) == 4 and len(next(iter(dm.val_dataloader()))) == 4


def test_synthetic_is_deterministic_and_val_disjoint():
    def images(dm, split):
        data = dm.train_dataset if split == "train" else dm.val_dataset
        return [np.asarray(data[i]["images"][0]).tobytes() for i in range(len(data))]

    a, b, c = (SFTDataModule(synthetic={**SMALL, "seed": s}, shuffle=False) for s in (3, 3, 4))
    for dm in (a, b, c):
        dm.setup()
    assert [r["messages"] for r in all_rows(a)] == [r["messages"] for r in all_rows(b)]
    assert images(a, "train") == images(b, "train")  # pixel-equal
    assert images(a, "train") != images(c, "train")
    assert not set(images(a, "train")) & set(images(a, "val"))
    # Shuffling is seeded too: the same seed gives the same order.
    s1, s2 = (SFTDataModule(synthetic=SMALL, batch_size=2, seed=7) for _ in range(2))
    s1.setup(), s2.setup()
    assert [r["messages"] for r in all_rows(s1)] == [r["messages"] for r in all_rows(s2)]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "disk", "dict"])
@pytest.mark.parametrize("shape", list(MODULES))
def test_local_sources(folder, kind, shape):
    spec = write(folder, kind, good_rows(shape))
    dm = MODULES[shape](train=spec, batch_size=8, shuffle=False)
    dm.setup("fit")
    rows = all_rows(dm)
    assert [pixel(r["images"][0]) for r in rows] == list(COLORS.values())
    assert all(len(r["images"]) == 1 and r["images"][0].mode == "RGB" for r in rows)
    key = "messages" if shape == "sft" else "prompt"
    assert rows[1][key][0]["content"] == [IMG, text("question 1?")]  # stored None keys dropped
    if shape == "prompt":
        assert [r["solution"] for r in rows] == ["s0", "s1", "s2"]
    if kind == "dict":  # the DatasetDict's own validation split
        dm = MODULES[shape](train=spec, val=spec, batch_size=8)
        dm.setup()
        assert len(dm.val_dataset) == 1
    else:
        assert dm.val_dataloader() == []


@pytest.mark.parametrize("kind", ["jsonl", "json", "jsonl.xz"])
def test_answers_that_look_like_json_stay_the_strings_written(folder, kind):
    # A user turn of blocks and an assistant string make the content column change type: datasets then
    # stores it as JSON text and read "4" back as the number 4 (the row was refused), a box as a list.
    answers = ["4", "[0.1, 0.2, 0.5, 0.6]", "true", "null", "red"]
    rows = [answered(a, "img/red.png") for a in answers]
    dm = SFTDataModule(train=write(folder, kind, rows), batch_size=8, shuffle=False, val_fraction=None)
    dm.setup("fit")
    assert [row["messages"][1]["content"] for row in all_rows(dm)] == [[text(a)] for a in answers]
    assert [pixel(row["images"][0]) for row in all_rows(dm)] == [(255, 0, 0)] * 5


@pytest.mark.parametrize("train", ["train.jsonl", "train.jsonl.gz"])
def test_a_folder_of_json_splits_keeps_the_strings_written(folder, train):
    # The same datasets behaviour through a plain folder of split files (their splits inferred from the
    # names), plain or compressed.
    # "red\u2028x": JSON Lines split at "\n" only, and JSON strings may hold U+2028 unescaped
    answers = ["4", "[0.1, 0.2, 0.5, 0.6]", "true", "null", "red\u2028x"]
    rows = [answered(a, "../img/red.png") for a in answers]
    (folder / "data").mkdir()
    lines = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode()
    (folder / "data" / train).write_bytes(gzip.compress(lines) if train.endswith(".gz") else lines)
    (folder / "data" / "validation.json").write_text(json.dumps(rows[::-1]))
    dm = SFTDataModule(train=str(folder / "data"), val=str(folder / "data"), batch_size=8, shuffle=False)
    dm.setup("fit")
    assert [row["messages"][1]["content"] for row in all_rows(dm)] == [[text(a)] for a in answers]
    val = [dm.val_dataset[i]["messages"][1]["content"] for i in range(len(dm.val_dataset))]
    assert val == [[text(a)] for a in answers[::-1]]
    with pytest.raises(
        SourceError, match=r"split 'test' of the data files in .*data: ValueError: Unknown split"
    ):
        sources.load_source(str(folder / "data"), "sft", "test")
    # datasets' slice specs pick the same rows
    sliced = sources.load_source(
        {"path": str(folder / "data"), "split": "train[1:-1]+validation[:40%]"}, "sft"
    ).rows
    assert [row["messages"][1]["content"] for row in sliced] == answers[1:4] + ["red\u2028x", "null"]
    every = sources.load_source({"path": str(folder / "data"), "split": "all"}, "sft").rows
    assert [row["messages"][1]["content"] for row in every] == answers + answers[::-1]


def test_a_folder_file_datasets_reads_by_its_content_falls_back_with_a_warning(folder, caplog):
    # datasets tells gzip by its magic bytes, not by the name: a gzipped "train.jsonl" loads there, and
    # our re-read (which goes by the name) cannot read it, so datasets' rows are used, said so.
    rows = [answered(a) for a in ["red", "blue"]]
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_bytes(
        gzip.compress("\n".join(json.dumps(r) for r in rows).encode())
    )
    dm = SFTDataModule(train=str(folder / "data"), batch_size=8, shuffle=False, val_fraction=None)
    dm.setup("fit")
    assert [row["messages"][1]["content"] for row in all_rows(dm)] == [[text("red")], [text("blue")]]
    assert "could not re-read ['train'] with Python's json" in caplog.text


def test_a_folder_datasets_reads_alone_says_its_strings_may_change(folder, caplog):
    # A zip archive stays with datasets: an answer that looks like JSON may come back changed, and the
    # log says so (here "4" then fails as a number, naming the row).
    rows = [answered(a) for a in ["red", "4"]]
    (folder / "data").mkdir()
    with zipfile.ZipFile(folder / "data" / "train.zip", "w") as z:
        z.writestr("train.jsonl", "\n".join(json.dumps(r) for r in rows))
    dm = SFTDataModule(train=str(folder / "data"), batch_size=8, shuffle=False, val_fraction=None)
    with pytest.raises(RowError, match=r"row 1, column 'messages'"):
        dm.setup("fit")
        all_rows(dm)
    assert "strings that look like JSON" in caplog.text and str(folder / "data") in caplog.text


def test_a_hub_or_saved_dataset_with_json_text_fields_is_warned_about(folder, monkeypatch, caplog):
    # No Hub here: the loader is handed the rows datasets makes of such a file, as it would from the Hub.
    rows = [answered("red")]
    (folder / "t.jsonl").write_text(json.dumps(rows[0]))
    arrow = datasets.load_dataset("json", data_files=str(folder / "t.jsonl"), split="train")
    monkeypatch.setattr(sources, "load_hf_dataset", lambda name, subset, split: arrow)
    assert len(sources.load_source("org/vqa", "sft").rows) == 1
    assert "org/vqa [train]: some field changes type" in caplog.text
    # a save_to_disk copy holds datasets' JSON text: warned about the same way
    arrow.save_to_disk(str(folder / "saved"))
    assert len(sources.load_source(str(folder / "saved"), "sft").rows) == 1
    assert f"{folder / 'saved'} [train]: some field changes type" in caplog.text


def test_plain_strings_become_typed_blocks_with_images_first(folder):
    two = ["img/red.png", "img/blue.png"]
    out = normalize_row(
        {"prompt": "Q", "chosen": "A", "rejected": "B", "images": two}, "preference", base_dir=folder
    )
    assert out["prompt"] == [{"role": "user", "content": [IMG, IMG, text("Q")]}]
    assert out["chosen"] == [{"role": "assistant", "content": [text("A")]}]
    assert out["images"] == [str(folder / p) for p in two]  # relative to the data folder
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    out = normalize_row({"messages": chat, "image": "img/red.png"}, "sft", base_dir=folder)
    assert [m["content"] for m in out["messages"]] == [[IMG, text("Hi")], [text("Yo")]]
    expected = {"prompt": [{"role": "user", "content": [text("2+2?")]}], "solution": "4", "images": []}
    assert normalize_row({"prompt": "2+2?", "solution": "4"}, "prompt") == expected
    # TRL's prompt-completion form also works for SFT.
    out = normalize_row({"prompt": "Hi", "completion": "Yo", "image": "img/red.png"}, "sft", base_dir=folder)
    assert [m["content"] for m in out["messages"]] == [[IMG, text("Hi")], [text("Yo")]]


def test_none_keys_dropped_and_implicit_prompt():
    stored = {"type": "image", "text": None}
    prompt = [
        {"role": "user", "content": [stored, {"type": "text", "text": "Q", "image": None}], "name": None}
    ]
    row = {
        "chosen": prompt + [{"role": "assistant", "content": "A"}],
        "rejected": prompt + [{"role": "assistant", "content": "B"}],
        "images": [Image.new("RGB", (4, 4))],
    }
    out = normalize_row(row, "preference")
    assert out["prompt"] == [{"role": "user", "content": [IMG, text("Q")]}]
    assert out["chosen"] == [{"role": "assistant", "content": [text("A")]}]
    assert out["rejected"] == [{"role": "assistant", "content": [text("B")]}]


def test_bytes_dicts_and_column_map(folder):
    png = (folder / "img/green.png").read_bytes()
    rows = [{"question": "Color?", "picture": {"bytes": png, "path": None}, "answer": "green"}]
    column_map = {"question": "prompt", "picture": "image"}
    dm = PromptDataModule(train=write(folder, "parquet", rows), column_map=column_map)
    dm.setup()
    (row,) = all_rows(dm)
    assert pixel(row["images"][0]) == COLORS["green.png"] and row["answer"] == "green"
    assert row["prompt"][0]["content"] == [IMG, text("Color?")]


def corrupt(rows, folder, case):
    """Break row 2 of SFT rows in one way; returns the column the error must name."""
    row = rows[2]
    if case == "missing_column":
        del row["messages"]
        return "messages"
    if case == "missing_image":
        row["images"] = ["img/nope.png"]
        return "images"
    if case == "image_count_mismatch":
        row["messages"][0]["content"] = [IMG, IMG, text("two?")]
        return "messages"
    if case == "wrong_type":
        row["messages"][0]["content"][1] = {"type": "text", "text": 7}
        return "messages"
    (folder / "img/bad.png").write_bytes(b"not a png")
    row["images"] = ["img/bad.png"]
    return "images"


CASES = ["missing_column", "missing_image", "image_count_mismatch", "wrong_type", "corrupt_image"]


@pytest.mark.parametrize("case", CASES)
def test_bad_rows_raise_naming_row_and_column(folder, case):
    rows = good_rows("sft")
    column = corrupt(rows, folder, case)
    # wrong_type via JSON would make Arrow fail on the mixed types, so give it in memory.
    if case == "wrong_type":
        with pytest.raises(RowError, match=f"row 2, column '{column}'.*wrong_type"):
            normalize_row(rows[2], "sft", index=2, base_dir=folder)
        return
    dm = SFTDataModule(train=write(folder, "jsonl", rows), shuffle=False)
    with pytest.raises(RowError, match=f"data.jsonl, row 2, column '{column}'.*{case}") as info:
        dm.setup()
        all_rows(dm)  # a corrupt image only shows when it is decoded
    assert info.value.index == 2 and info.value.reason == case


def test_skip_mode_counts_and_logs(folder, caplog):
    rows = good_rows("sft") * 2
    rows = [json.loads(json.dumps(r)) for r in rows]  # independent copies
    corrupt(rows, folder, "missing_column")
    rows[3]["images"] = ["img/nope.png"]
    (folder / "img/bad.png").write_bytes(b"not a png")
    rows[4]["image"] = "img/bad.png"
    dm = SFTDataModule(train=write(folder, "jsonl", rows), on_bad_row="skip", batch_size=8, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        dm.setup()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "lightning_vlm.data"]
    assert "skipped 2 of 6 rows" in message and "1 missing_column, 1 missing_image" in message
    assert dm.skipped == {"missing_column": 1, "missing_image": 1}
    assert dm.train_dataset.indices == [0, 1, 4, 5]
    assert len(all_rows(dm)) == 3  # the corrupt image is found at load, dropped and counted
    assert dm.skipped["corrupt_image"] == 1


def test_preference_checks_roles_and_prompt():
    with pytest.raises(RowError, match="row 0, column 'chosen'.*assistant"):
        normalize_row({"prompt": "Q", "chosen": user(text("A")), "rejected": "B"}, "preference")
    with pytest.raises(RowError, match="column 'prompt'.*missing_column"):
        normalize_row({"chosen": "A", "rejected": "B"}, "preference")
    with pytest.raises(RowError, match="column 'images'.*both"):
        normalize_row({"prompt": "Q", "image": "a.png", "images": ["b.png"]}, "prompt", check_files=False)


def test_source_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceError, match="could not load dataset 'someone/no-such-dataset'.*Hub"):
        SFTDataModule(train="someone/no-such-dataset").setup()
    with pytest.raises(SourceError, match="no such file"):
        SFTDataModule(train=str(tmp_path / "missing.jsonl")).setup()
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])})
    saved.save_to_disk(str(tmp_path / "d"))
    with pytest.raises(SourceError, match="without split 'test'"):
        PromptDataModule(train={"path": str(tmp_path / "d"), "split": "test"}).setup()


def test_hydra_instantiate_with_dictconfig():
    from hydra.utils import instantiate

    synthetic = {**SMALL, "kinds": ["shape", "count"]}
    dm = instantiate(
        {"_target_": "lightning_vlm.data.PreferenceDataModule", "batch_size": 2, "synthetic": synthetic}
    )
    dm.setup()
    assert len(next(iter(dm.train_dataloader()))) == 2 and dm.hparams.batch_size == 2
