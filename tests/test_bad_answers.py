"""Preference and KTO rows whose answers would train wrongly, and sources with no rows: each refused at
setup naming the file, row and column (a helper review found them loaded without a word, or failing
mid-training, or in the dependency's own words)."""

from __future__ import annotations

import pytest
from test_data import COLORS, folder, good_rows, hf_cache, pixel, write  # noqa: F401  (fixtures)

from lightning_vlm.data import PreferenceDataModule, RowError, SourceError, UnpairedDataModule

ANSWER = [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]


def image_answer(colour: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": colour}]}]


def _unpaired(pairs: list[dict]) -> list[dict]:
    """The pairs' chosen answers as KTO rows."""
    return [
        {k: v for k, v in p.items() if k != "rejected"} | {"completion": p["chosen"], "label": True}
        for p in [{k: v for k, v in p.items() if k != "chosen"} | {"chosen": p["chosen"]} for p in pairs]
    ]


def _pairs(**change) -> list[dict]:
    pairs = good_rows("preference")
    pairs[1].update(change)
    return pairs


CASES = {
    # DPO: the rows passed setup and failed in the first batch holding them, naming only the batch's row
    "dpo_image_in_answers": (PreferenceDataModule, _pairs(prompt="Color?", chosen=image_answer("red"), rejected=image_answer("blue")),
                             "row 1, column 'chosen'", "images inside 'chosen'"),
    "kto_image_in_completion": (UnpairedDataModule, _unpaired(_pairs(prompt="Color?", chosen=image_answer("red"))),
                                "row 1, column 'completion'", "images inside 'completion'"),
    # an empty answer (a missing value written as ""): trained on the end-of-turn token alone
    "dpo_empty_chosen": (PreferenceDataModule, _pairs(chosen=" "), "row 1, column 'chosen'", "no_answer"),
    "kto_empty_completion": (UnpairedDataModule, _unpaired(_pairs(chosen="")), "row 1, column 'completion'",
                             "no_answer"),
    # KTO reading a pair whose answers are the same: one answer both desirable and undesirable
    "kto_pair_same_answer": (UnpairedDataModule, _pairs(rejected=ANSWER), "row 2, column 'chosen'",
                             "pair 1: 'chosen' and 'rejected' are the same answer"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_answer_is_refused_at_setup_naming_the_row(folder, case):  # noqa: F811
    module, rows, where, what = CASES[case]
    with pytest.raises(RowError, match=rf"data\.jsonl.*{where}") as info:
        module(train=write(folder, "jsonl", rows)).setup()
    assert what in str(info.value)
    skipping = module(train=write(folder, "jsonl", rows), on_bad_row="skip", batch_size=8)
    skipping.setup()  # skippable: the other rows train
    assert sum(skipping.skipped.values()) == (2 if case == "kto_pair_same_answer" else 1)


def test_a_parquet_file_without_rows_says_so(folder):  # noqa: F811
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), folder / "none.parquet")
    # was "could not be read as parquet data: ArrowInvalid: BatchSize must be greater than 0, got 0"
    with pytest.raises(SourceError, match=r"none\.parquet: .*no rows"):
        PreferenceDataModule(train=str(folder / "none.parquet")).setup()


def test_a_saved_dataset_without_rows_says_so(folder):  # noqa: F811
    import datasets

    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(folder / "saved"))
    # was a bare IndexError from inside datasets' load_from_disk
    with pytest.raises(SourceError, match=r"saved.*no rows"):
        PreferenceDataModule(train=str(folder / "saved")).setup()


def test_an_empty_rejected_or_undesirable_answer_is_kept(folder):  # noqa: F811
    # Not ending the turn at once is a signal (TRL takes such rows); only an empty answer to prefer is refused.
    dm = PreferenceDataModule(train=write(folder, "jsonl", _pairs(rejected="")), batch_size=8)
    dm.setup()
    assert len(dm.train_dataset) == 3
    rows = _unpaired(_pairs(chosen=""))
    rows[1]["label"] = False
    dm = UnpairedDataModule(train=write(folder, "jsonl", rows), batch_size=8)
    dm.setup()
    assert len(dm.train_dataset) == 3
