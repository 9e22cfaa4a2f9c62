"""KTO on paired data: preference pairs become two unpaired rows each (TRL's KTOTrainer does the same),
from every source kind, with explicit or implicit prompts and renamed columns; errors trace to the pair."""

from __future__ import annotations

import pytest
from test_data import COLORS, folder, good_rows, hf_cache, pixel, write  # noqa: F401  (fixtures)

from lightning_vlm.data import RowError, UnpairedDataModule


def _rows(dm) -> list[dict]:
    return [row for batch in dm.train_dataloader() for row in batch]


def _text(messages: list[dict]) -> str:
    return " ".join(b["text"] for m in messages for b in m["content"] if b["type"] == "text")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_pairs_become_a_desirable_and_an_undesirable_row(folder, kind):  # noqa: F811
    dm = UnpairedDataModule(train=write(folder, kind, good_rows("preference")), shuffle=False, batch_size=8)
    dm.setup()
    rows = _rows(dm)
    assert len(rows) == 6 and "unpaired (row 2i: pair i's chosen answer" in dm.train_dataset.source.name
    assert [r["label"] for r in rows] == [True, False] * 3
    assert [_text(r["completion"]) for r in rows] == ["red", "blue"] * 3
    for i, row in enumerate(rows):
        assert _text(row["prompt"]) == f"question {i // 2}?" and "chosen" not in row and "rejected" not in row
        # both rows of a pair carry the pair's image
        assert pixel(row["images"][0]) == list(COLORS.values())[i // 2]


def test_implicit_prompts_and_renamed_columns(folder):  # noqa: F811
    implicit = [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"],
                 **{k: v for k, v in p.items() if k in ("image", "images")}}
                for p in good_rows("preference")]  # fmt: skip
    dm = UnpairedDataModule(train=write(folder, "jsonl", implicit), shuffle=False, batch_size=8)
    rows = (dm.setup(), _rows(dm))[1]
    assert [_text(r["prompt"]) for r in rows] == ["question 0?", "question 0?", "question 1?", "question 1?",
                                                  "question 2?", "question 2?"]  # fmt: skip
    assert [_text(r["completion"]) for r in rows] == ["red", "blue"] * 3

    renamed = [{"question": p["prompt"], "good": p["chosen"], "bad": p["rejected"],
                **{k: v for k, v in p.items() if k in ("image", "images")}} for p in good_rows("preference")]  # fmt: skip
    dm = UnpairedDataModule(train=write(folder, "jsonl", renamed), shuffle=False, batch_size=8,
                            column_map={"question": "prompt", "good": "chosen", "bad": "rejected"})  # fmt: skip
    rows = (dm.setup(), _rows(dm))[1]
    assert [r["label"] for r in rows] == [True, False] * 3
    assert [_text(r["completion"]) for r in rows] == ["red", "blue"] * 3


def test_unpaired_data_is_read_as_it_is(folder):  # noqa: F811
    rows = [{"prompt": p["prompt"], "completion": p["chosen"], "label": i != 1,
             **{k: v for k, v in p.items() if k in ("image", "images")}}
            for i, p in enumerate(good_rows("preference"))]  # fmt: skip
    dm = UnpairedDataModule(train=write(folder, "jsonl", rows), shuffle=False, batch_size=8)
    dm.setup()
    assert [r["label"] for r in _rows(dm)] == [True, False, True]
    assert "unpaired (row" not in dm.train_dataset.source.name


def test_a_bad_pair_names_its_unpaired_row_and_the_pair_rule(folder):  # noqa: F811
    pairs = good_rows("preference")
    pairs[1]["rejected"] = [{"role": "user", "content": [{"type": "text", "text": "not an answer"}]}]
    dm = UnpairedDataModule(train=write(folder, "jsonl", pairs), shuffle=False)
    with pytest.raises(RowError, match=r"row 2i\+1: its rejected one\), row 3, column 'completion'"):
        dm.setup()


def test_fit_warns_when_the_weights_do_not_suit_the_label_balance(folder, tmp_path, caplog):  # noqa: F811
    from helpers import compose_train
    from lightning_vlm.training import train

    pairs = good_rows("preference")  # 3 pairs: 3 desirable and 3 undesirable rows
    unpaired = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True, "images": p.get("images")
                 or [p["image"]]} for p in pairs]  # fmt: skip
    path = write(folder, "jsonl", unpaired + [{**unpaired[0], "label": False}])
    assert UnpairedDataModule(train=path).label_counts() == (3, 1)
    run = ["method=kto", f"data.train={path}", "tiny_start=random", "logger=none", "callbacks=none",
           "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
           "validate_before_fit=false", "data.batch_size=4"]  # fmt: skip
    with caplog.at_level("WARNING", logger="lightning_vlm.methods.kto"):
        train(compose_train(run, tmp_path / "3to1"))
    assert (
        "= 3, outside the paper's [1, 4/3]: set EITHER method.desirable_weight in [0.334, 0.444]"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_vlm.methods.kto"):
        train(compose_train([*run, "method.desirable_weight=0.4"], tmp_path / "weighted"))
    assert "outside the paper's" not in caplog.text
    # write() reuses the folder's data file: the pairs last
    assert UnpairedDataModule(train=write(folder, "jsonl", pairs)).label_counts() == (3, 3)


def test_val_fraction_holds_out_whole_pairs(folder):  # noqa: F811
    # Rows 2i and 2i+1 (one prompt, one image) were held out one by one: 6 of 8 validation prompts were
    # also trained on.
    pairs = [{**p, "prompt": [{"role": "user", "content": [{"type": "image"},
                                                           {"type": "text", "text": f"question {i}{j}?"}]}]}
             for i, p in enumerate(good_rows("preference")) for j in range(7)]  # fmt: skip
    dm = UnpairedDataModule(
        train=write(folder, "jsonl", pairs), shuffle=False, batch_size=8, val_fraction=0.25
    )
    dm.setup()
    train = [_text(r["prompt"]) for r in dm.train_dataset.normalized()]
    val = [_text(r["prompt"]) for r in dm.val_dataset.normalized()]
    assert len(val) == 2 * round(0.25 * len(pairs)) and len(train) + len(val) == 2 * len(pairs)
    assert not set(val) & set(train)


@pytest.mark.parametrize("mixed", [False, True], ids=["stored_none", "absent_key"])
@pytest.mark.parametrize("missing", ["chosen", "rejected"])
def test_a_pair_without_an_answer_names_the_column_and_is_skippable(folder, missing, mixed):  # noqa: F811
    pairs = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(3)]
    del pairs[1][missing]  # datasets fills the absent key with None
    if mixed:  # a column that changes type: read with Python's json, where the key stays absent
        pairs[2]["chosen"] = [{"role": "assistant", "content": "good"}]
    path = write(folder, "jsonl", pairs)
    dm = UnpairedDataModule(train=path, shuffle=False)
    with pytest.raises(RowError, match=rf"row 2, column '{missing}'.*pair 1 has no '{missing}'") as info:
        dm.setup()
    assert info.value.reason == "missing_column"
    dm = UnpairedDataModule(train=path, shuffle=False, on_bad_row="skip", batch_size=8)
    dm.setup()
    # both rows of the broken pair are skipped: half a pair would tip the label balance
    assert dm.train_dataset.indices == [0, 1, 4, 5] and dm.skipped == {"missing_column": 2}
    assert [r["label"] for r in _rows(dm)] == [True, False, True, False]


@pytest.mark.parametrize("limit, kept", [(5, 4), (1, 2), (4, 4)])
def test_an_odd_max_samples_keeps_whole_pairs(folder, limit, kept, caplog):  # noqa: F811
    # max_samples=5 on pairs kept pair 2's chosen answer alone: one more desirable row than undesirable.
    pairs = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(4)]
    path = write(folder, "jsonl", pairs)
    dm = UnpairedDataModule(train=path, val=path, max_samples=limit, max_val_samples=limit, shuffle=False)
    with caplog.at_level("INFO", logger="lightning_vlm.data"):
        dm.setup()
    assert len(dm.train_dataset) == len(dm.val_dataset) == kept
    assert dm.label_counts() == (kept // 2, kept // 2)
    assert ("whole pairs" in caplog.text) == (limit != kept)
    # Held out of train (val_fraction), the validation pairs are cut whole too; with no validation at all
    # the setting has nothing to cut.
    dm = UnpairedDataModule(train=path, val_fraction=0.5, max_val_samples=limit, shuffle=False)
    dm.setup()
    assert len(dm.val_dataset) == min(kept, 4) and len(dm.val_dataset) % 2 == 0
    dm = UnpairedDataModule(train=path, max_val_samples=limit, shuffle=False)
    dm.setup()
    assert dm.val_dataset is None and len(dm.train_dataset) == 8
    unpaired = [{"prompt": f"q{i}", "completion": "a", "label": i % 3 == 0} for i in range(6)]
    dm = UnpairedDataModule(train=write(folder, "jsonl", unpaired), max_samples=limit, shuffle=False)
    dm.setup()
    assert len(dm.train_dataset) == limit  # unpaired rows have no pairs to keep whole
