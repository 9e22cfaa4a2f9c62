"""Plain folders of data files, and JSON files only Python's json reads: a row's relative image paths
start beside its own data file (as for that file given alone), and a field that changes type between
rows loads whatever else the file holds (blank lines)."""

from __future__ import annotations

import json

import datasets
import pytest
from PIL import Image

from lightning_vlm.data import PromptDataModule, SourceError, UnpairedDataModule, sources


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


COLOURS = {"train": (255, 0, 0), "validation": (0, 0, 255)}


def write_rows(path, rows: list[dict], kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path.with_suffix(".parquet")))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def split_folders(root, kind: str) -> None:
    """``root/<split>/part.jsonl`` (or .parquet) beside its own ``a.png``, red for train, blue for
    validation: the same relative path names a different image in each folder."""
    for split, colour in COLOURS.items():
        (root / split).mkdir(parents=True)
        Image.new("RGB", (8, 8), colour).save(root / split / "a.png")
        # "mixed": a solution that is a number in one row and a string in the next (datasets' JSON text)
        solutions = [1, "s"] if kind == "mixed" else ["s", "t"]
        rows = [{"prompt": f"{split}{i}", "image": "a.png", "solution": s} for i, s in enumerate(solutions)]
        write_rows(root / split / "part.jsonl", rows, kind)


def pixels(source) -> list[tuple]:
    """The top-left pixel of each row's image, loaded as training loads it."""
    dm = PromptDataModule(train=source, val_fraction=None, shuffle=False)
    dm.setup("fit")
    return [dm.train_dataset[i]["images"][0].getpixel((0, 0)) for i in range(len(dm.train_dataset))]


@pytest.mark.parametrize("kind", ["jsonl", "mixed", "parquet"])
def test_a_folder_reads_each_rows_images_beside_its_own_data_file(tmp_path, kind):
    split_folders(tmp_path / "root", kind)
    red, blue = COLOURS["train"], COLOURS["validation"]
    root = str(tmp_path / "root")
    assert pixels(root) == [red, red]
    assert pixels({"path": root, "split": "validation"}) == [blue, blue]
    assert pixels({"path": root, "split": "validation[1:]+train[:1]"}) == [blue, red]
    assert pixels({"path": root, "split": "all"}) == [red, red, blue, blue]


def test_a_folder_with_its_files_in_a_subfolder_reads_images_beside_them(tmp_path):
    # The layout of a Hub repository: root/data/train.jsonl next to root/data/a.png.
    (tmp_path / "root" / "data").mkdir(parents=True)
    Image.new("RGB", (8, 8), (0, 255, 0)).save(tmp_path / "root" / "data" / "a.png")
    write_rows(tmp_path / "root" / "data" / "train.jsonl", [{"prompt": "q", "image": "a.png"}] * 3, "jsonl")
    assert pixels(str(tmp_path / "root")) == [(0, 255, 0)] * 3
    # the same file given alone reads the same images
    assert pixels(str(tmp_path / "root" / "data" / "train.jsonl")) == [(0, 255, 0)] * 3


def test_kto_pairs_of_a_folder_read_their_images_beside_their_file(tmp_path):
    for split, colour in COLOURS.items():
        (tmp_path / "root" / split).mkdir(parents=True)
        Image.new("RGB", (8, 8), colour).save(tmp_path / "root" / split / "a.png")
        pair = {"prompt": f"{split}?", "chosen": "yes", "rejected": "no", "image": "a.png"}
        write_rows(tmp_path / "root" / split / "pairs.jsonl", [pair], "jsonl")
    dm = UnpairedDataModule(
        train={"path": str(tmp_path / "root"), "split": "all"}, val_fraction=None, shuffle=False
    )
    dm.setup("fit")
    got = [dm.train_dataset[i]["images"][0].getpixel((0, 0)) for i in range(len(dm.train_dataset))]
    red, blue = COLOURS["train"], COLOURS["validation"]
    assert got == [red, red, blue, blue]  # pair i's chosen and rejected rows share its file's image


def mixed_with_blank_line() -> str:
    rows = [{"prompt": "q0", "solution": 1}, {"prompt": "q1", "solution": "s"}]
    return json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n"


def test_a_field_changing_type_beside_a_blank_line_loads_as_written(tmp_path):
    # datasets' JSON reader fails on this file ("changed from number to string"); Python's json reads it.
    (tmp_path / "mixed.jsonl").write_text(mixed_with_blank_line())
    rows = sources.load_source(str(tmp_path / "mixed.jsonl"), "prompt").rows
    assert [(r["prompt"], r["solution"]) for r in rows] == [("q0", 1), ("q1", "s")]
    rows = sources.load_source({"path": str(tmp_path / "mixed.jsonl"), "split": "train[1:]"}, "prompt").rows
    assert [r["solution"] for r in rows] == ["s"]
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "train.jsonl").write_text(mixed_with_blank_line())
    rows = sources.load_source(str(tmp_path / "root"), "prompt").rows
    assert [(r["prompt"], r["solution"]) for r in rows] == [("q0", 1), ("q1", "s")]


def test_a_broken_json_line_still_names_its_line_in_a_folder(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "train.jsonl").write_text('{"prompt": "q0", "solution": 1}\n\n{"prompt": "q1",\n')
    # The folder's error named neither the file nor the line (datasets' "An error occurred while
    # generating the dataset"): it names both, as for the file given alone.
    for source in (tmp_path / "root", tmp_path / "root" / "train.jsonl"):
        with pytest.raises(SourceError, match=r"train\.jsonl: .*line 3, column"):
            sources.load_source(str(source), "prompt")


@pytest.mark.parametrize(
    "content, problem",
    [(b"", "empty"), (b"  \n", "only whitespace"), (b'{"prompt": "caf\xe9"}\n', "UTF-8")],
    ids=["empty", "whitespace", "latin1"],
)
def test_a_bad_json_file_in_a_folder_is_named_with_its_problem(tmp_path, content, problem):
    # A folder gave datasets' words (a bare StopIteration, 'Instruction "train" corresponds to no data!')
    # or, for a Latin-1 byte, a pyarrow traceback from the first row read; a file alone named the problem.
    write_rows(tmp_path / "root" / "validation.jsonl", [{"prompt": "q"}], "jsonl")
    (tmp_path / "root" / "train.jsonl").write_bytes(content)
    with pytest.raises(SourceError, match=rf"train\.jsonl: .*{problem}"):
        PromptDataModule(train=str(tmp_path / "root")).setup()


def test_a_folder_mixing_file_types_in_a_split_is_refused_naming_the_files_left_out(tmp_path):
    # datasets reads one file type per folder (the most common) and left the others out: 7 rows in
    # train.jsonl, train_more.json and train_extra.parquet trained as the parquet's 2, with no warning.
    folder = tmp_path / "root"
    write_rows(folder / "train.jsonl", [{"prompt": f"q{i}"} for i in range(3)], "jsonl")
    write_rows(folder / "train_more.json", [{"prompt": f"q{i}"} for i in range(3, 5)], "jsonl")
    write_rows(folder / "train_extra.parquet", [{"prompt": f"q{i}"} for i in range(5, 7)], "parquet")
    with pytest.raises(SourceError, match=r"(?s)split 'train'.*train\.jsonl.*train_more\.json"):
        PromptDataModule(train=str(folder)).setup()
    (folder / "train_extra.parquet").unlink()  # one type: every file read
    dm = PromptDataModule(train=str(folder))
    dm.setup()
    assert len(dm.train_dataset) == 5


def test_a_folder_datasets_reads_as_an_image_folder_names_the_data_files_it_ignored(tmp_path):
    # COCO/LLaVA's layout: train.jsonl beside images/train2014/*.jpg. datasets takes the jpgs for the
    # "train" split (an image folder) and ignores the JSONL: rows failed on a missing 'prompt' column.
    folder = tmp_path / "ds"
    (folder / "images" / "train2014").mkdir(parents=True)
    names = [f"images/train2014/{i}.jpg" for i in range(3)]
    for name in names:
        Image.new("RGB", (8, 8)).save(folder / name)
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"prompt": "q", "image": n}) for n in names))
    with pytest.raises(
        SourceError, match=r"(?s)reads it as an image folder.*train\.jsonl.*data\.train=.*train\.jsonl"
    ):
        PromptDataModule(train=str(folder)).setup()
    dm = PromptDataModule(train=str(folder / "train.jsonl"))  # the file itself, as the error says
    dm.setup()
    assert len(dm.train_dataset) == 3


def test_a_folder_whose_card_names_its_files_is_read_as_the_card_says(tmp_path):
    # A local copy of a hub dataset repo: its card's configs name the files (en/ by default). The
    # left-out check took zh/train.parquet (same type, another config) for a file datasets dropped.
    folder = tmp_path / "repo"
    write_rows(folder / "en" / "train.parquet", [{"prompt": "q0"}, {"prompt": "q1"}], "parquet")
    write_rows(folder / "zh" / "train.parquet", [{"prompt": "q2"}], "parquet")
    write_rows(folder / "raw" / "train.jsonl", [{"prompt": "q3"}], "jsonl")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  default: true\n  data_files:\n  - split: train\n"
        "    path: en/train.parquet\n- config_name: zh\n  data_files:\n  - split: train\n"
        "    path: zh/train.parquet\n---\n# a card\n"
    )
    dm = PromptDataModule(train=str(folder))
    dm.setup()
    assert len(dm.train_dataset) == 2


@pytest.mark.parametrize("files", [["train.parquet"], ["train-0.parquet", "train-1.parquet"]])
def test_a_parquet_file_without_rows_in_a_folder_is_named(tmp_path, files):
    # The folder gave datasets' "An error occurred while generating the dataset", naming no file.
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "root").mkdir()
    if len(files) > 1:
        write_rows(tmp_path / "root" / files[0], [{"prompt": "q"}], "parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "root" / files[-1])
    with pytest.raises(SourceError, match=rf"{files[-1]}: the file holds no rows"):
        PromptDataModule(train=str(tmp_path / "root")).setup()


def test_a_saved_dataset_dict_with_an_empty_split_loads_its_other_splits(tmp_path):
    # datasets cannot load a DatasetDict one of whose splits has no rows (a bare IndexError); the split
    # asked for loads, and the empty one is named when it is the one asked for.
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"prompt": ["q0", "q1"]}),
         "validation": datasets.Dataset.from_dict({"prompt": []})}
    ).save_to_disk(str(tmp_path / "saved"))  # fmt: skip
    dm = PromptDataModule(train=str(tmp_path / "saved"))
    dm.setup()
    assert len(dm.train_dataset) == 2
    with pytest.raises(SourceError, match=r"split 'validation' of .*saved holds no rows"):
        PromptDataModule(train={"path": str(tmp_path / "saved"), "split": "validation"}).setup()
