"""Rows that loaded and trained wrongly without a word (a reviewer's finds), each now read as meant or
refused naming the row: KTO's label stored as a datasets ClassLabel (read by its class index, which
``class_encode_column`` sorts: desirable rows trained as undesirable), one empty assistant turn in a
multi-turn SFT row (trained to answer nothing), and a ShareGPT row's ``system`` column (LLaMA-Factory's:
dropped, the conversation trained without its system prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from lightning_vlm.data import RowError, SFTDataModule, SourceError, UnpairedDataModule


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def feedback(labels: list[str], column: str = "label") -> datasets.Dataset:
    """KTO rows with these labels as a ClassLabel column made by ``class_encode_column`` (names sorted)."""
    rows = [
        {"prompt": f"Q{i}?", "completion": f"answer {i}", column: label} for i, label in enumerate(labels)
    ]
    return datasets.Dataset.from_list(rows).class_encode_column(column)


def saved(dataset: datasets.Dataset, folder: Path, kind: str) -> str:
    """``dataset`` as a source of ``kind``: a save_to_disk folder, or a parquet file (which keeps its features)."""
    if kind == "parquet":
        dataset.to_parquet(str(folder / "data.parquet"))
        return str(folder / "data.parquet")
    dataset.save_to_disk(str(folder / "saved"))
    return str(folder / "saved")


def labels(dm: UnpairedDataModule) -> list[bool]:
    dm.setup()
    return [dm.train_dataset[i]["label"] for i in range(len(dm.train_dataset))]


NAMES = [["desirable", "undesirable"], ["accepted", "rejected"], ["Correct", "Incorrect"], ["True", "False"],
         ["good", "bad"], ["yes", "no"], ["chosen", "rejected"], ["POSITIVE", "negative"]]  # fmt: skip


@pytest.mark.parametrize("kind", ["disk", "parquet"])
@pytest.mark.parametrize("names", NAMES, ids=lambda n: "_".join(n))
def test_a_class_label_is_read_by_its_names_not_its_index(tmp_path, kind, names):
    # class_encode_column sorts the names: "desirable" is class 0, which as a 0/1 label read False.
    good, bad = names
    dataset = feedback([good, bad, good])
    assert isinstance(dataset.features["label"], datasets.ClassLabel)
    dm = UnpairedDataModule(train=saved(dataset, tmp_path, kind), shuffle=False, batch_size=8)
    assert labels(dm) == [True, False, True]
    assert dm.label_counts() == (2, 1)


def test_a_renamed_class_label_column_and_one_class_only(tmp_path):
    dm = UnpairedDataModule(train=saved(feedback(["desirable"] * 2, "kto_tag"), tmp_path, "disk"),
                            column_map={"kto_tag": "label"}, shuffle=False)  # fmt: skip
    assert labels(dm) == [True, True]


@pytest.mark.parametrize("names", [["a", "b"], ["desirable", "meh"], ["0", "1"]], ids=str)
def test_class_names_that_do_not_say_which_is_desirable_are_refused_before_training(tmp_path, names):
    dataset = feedback(names)
    with pytest.raises(SourceError, match=r"column 'label' is a datasets ClassLabel with names") as info:
        UnpairedDataModule(train=saved(dataset, tmp_path, "disk")).setup()
    message = str(info.value)
    assert str(tmp_path / "saved") in message and str(dataset.features["label"].names) in message
    assert "desirable/undesirable" in message


def test_a_missing_class_is_a_missing_label(tmp_path):
    dataset = feedback(["desirable", "undesirable"]).cast_column("label", datasets.Value("int64"))
    dataset = dataset.map(lambda row, i: {"label": -1 if i else row["label"]}, with_indices=True)
    dataset = dataset.cast_column("label", datasets.ClassLabel(names=["desirable", "undesirable"]))
    with pytest.raises(RowError, match=r"row 1, column 'label': missing required column"):
        UnpairedDataModule(train=saved(dataset, tmp_path, "disk")).setup()


def test_string_labels_in_a_json_file_are_still_refused(tmp_path):
    # A ClassLabel's names are declared once, for the whole column; a JSON file's strings are the rows'
    # own, each a guess ("False", "no ", "0.0"): KTO's label there stays true or false.
    rows = [{"prompt": "Q?", "completion": "A", "label": "desirable"}]
    (tmp_path / "data.jsonl").write_text(json.dumps(rows[0]))
    with pytest.raises(RowError, match=r"row 0, column 'label': 'label' must be true or false"):
        UnpairedDataModule(train=str(tmp_path / "data.jsonl")).setup()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


def sft_file(folder: Path, rows: list[dict]) -> str:
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(folder / "data.jsonl")


HI = [user("Say hi"), assistant("hi"), user("And the capital of France?")]


@pytest.mark.parametrize("empty", ["", "  \n", None])
def test_one_empty_assistant_turn_among_good_ones_is_refused_naming_it(tmp_path, empty):
    # The reviewer's row trained 'hi<|im_end|><|im_end|>': its last answer the end-of-turn token alone.
    rows = [{"messages": [*HI, assistant("Paris")]}, {"messages": [*HI, assistant(empty)]}]
    if empty is None:  # a turn of blocks without a text block
        rows[1]["messages"][3]["content"] = []
    with pytest.raises(RowError, match=r"data\.jsonl, row 1, column 'messages': SFT row with an empty "
                       r"assistant turn, message 3 .*\[no_answer\]"):  # fmt: skip
        SFTDataModule(train=sft_file(tmp_path, rows)).setup()
    skipping = SFTDataModule(train=sft_file(tmp_path, rows), on_bad_row="skip")
    skipping.setup()
    assert len(skipping.train_dataset) == 1 and skipping.skipped == {"no_answer": 1}


def test_an_empty_turn_not_trained_on_is_context(tmp_path):
    # ms-swift's "loss": false leaves a turn untrained: empty, it teaches nothing, and stays.
    rows = [{"messages": [*HI[:1], assistant("", loss=False), *HI[2:], assistant("Paris")]}]
    dm = SFTDataModule(train=sft_file(tmp_path, rows))
    dm.setup()
    assert len(dm.train_dataset) == 1


def test_an_empty_completion_message_is_refused_naming_it():
    from lightning_vlm.data.rows import normalize_row

    row = {"prompt": "Q?", "completion": [assistant("Well,"), assistant(" ")]}
    with pytest.raises(RowError, match=r"column 'completion': .*empty assistant turn, message 1"):
        normalize_row(row, "sft")


def sharegpt(system: object = None, *turns: tuple[str, str]) -> dict:
    turns = turns or (("human", "Who are you?"), ("gpt", "A pirate, arr."))
    row = {"conversations": [{"from": who, "value": text} for who, text in turns]}
    return row if system is None else {**row, "system": system}


PIRATE = "You are a pirate. Answer like one."


def test_a_sharegpt_system_column_is_the_conversations_system_turn(tmp_path, vlms):
    rows = [sharegpt(PIRATE), sharegpt(""), sharegpt(None)]
    dm = SFTDataModule(train=sft_file(tmp_path, rows), shuffle=False)
    dm.setup()
    first, blank, without = (dm.train_dataset[i] for i in range(3))
    assert first["messages"][0] == {"role": "system", "content": [{"type": "text", "text": PIRATE}]}
    assert "system" not in first  # read, not passed through as a column
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert (
        [m["role"] for m in blank["messages"]]
        == [m["role"] for m in without["messages"]]
        == ["user", "assistant"]
    )
    # rendered by a chat template, before the conversation, and not trained on
    vlm = vlms("qwen2_5_vl")
    batch = vlm.encode_sft([first])
    text = vlm.tokenizer.decode(batch["input_ids"][0])
    assert text.index(f"<|im_start|>system\n{PIRATE}<|im_end|>") < text.index("Who are you?")
    labels = batch["labels"][0]
    assert PIRATE not in vlm.tokenizer.decode(labels[labels != -100])


def test_a_sharegpt_system_column_wins_over_the_system_prompt_setting(tmp_path):
    # data.system_prompt goes in front of a conversation without a system turn of its own.
    dm = SFTDataModule(train=sft_file(tmp_path, [sharegpt(PIRATE)]), system_prompt="Be brief.")
    dm.setup()
    assert [
        b["text"] for m in dm.train_dataset[0]["messages"] if m["role"] == "system" for b in m["content"]
    ] == [PIRATE]


@pytest.mark.parametrize(
    ("row", "detail"),
    [
        (sharegpt(PIRATE, ("system", "Be brief."), ("human", "Hi"), ("gpt", "Arr")),
         "a system turn in its conversation (message 0): which one is meant?"),
        (sharegpt(["You are a pirate."]), "must be text, got list"),
    ],
    ids=["both", "not_text"],
)  # fmt: skip
def test_a_sharegpt_system_column_that_cannot_be_the_system_turn_is_refused(tmp_path, row, detail):
    with pytest.raises(RowError, match=r"data\.jsonl, row 0, column 'system'") as info:
        SFTDataModule(train=sft_file(tmp_path, [row])).setup()
    assert detail in str(info.value)


SURE = assistant("Sure, the answer is")  # a prefill: TRL continues it (continue_final_message)


@pytest.mark.parametrize(
    ("shape", "row", "column"),
    [
        ("prompt", {"prompt": [user("Q?"), SURE]}, "prompt"),
        (
            "prompt",
            {"messages": [user("Q?"), SURE, assistant("B")]},
            "messages",
        ),  # ms-swift's, answer dropped
        ("preference", {"prompt": [user("Q?"), SURE], "chosen": "B", "rejected": "C"}, "prompt"),
        (
            "preference",
            {"chosen": [user("Q?"), SURE, assistant("B")], "rejected": [user("Q?"), SURE, assistant("C")]},
            "chosen",
        ),  # fmt: skip
        ("unpaired", {"prompt": [user("Q?"), SURE], "completion": "B", "label": True}, "prompt"),
    ],
)
def test_a_prompt_ending_with_an_assistant_turn_is_refused_naming_it(shape, row, column):
    # The chat template closed the prefill's turn and opened a new one: the answer followed a finished
    # "Sure, the answer is" turn, where TRL continues it.
    from lightning_vlm.data.rows import normalize_row

    with pytest.raises(RowError, match=rf"column '{column}': .*ends with an assistant turn \(message 1\)"):
        normalize_row(row, shape)


def test_a_multi_turn_prompt_ending_with_the_users_turn_is_read():
    from lightning_vlm.data.rows import normalize_row

    roles = ["user", "assistant", "user"]
    assert [m["role"] for m in normalize_row({"prompt": HI}, "prompt")["prompt"]] == roles
    row = normalize_row({"prompt": HI, "completion": "Paris", "label": True}, "unpaired")
    assert [m["role"] for m in row["prompt"]] == roles and row["label"] is True
