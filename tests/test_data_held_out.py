"""``data.val_fraction`` holds out whole prompts: rows that share a prompt and its images (several answers,
pairs or samples of one question) go to validation together or not at all."""

from __future__ import annotations

import logging

import pytest
from test_data import MODULES, folder, hf_cache, write  # noqa: F401  (fixtures)

from lightning_vlm.data import PromptDataModule

QUESTIONS, ANSWERS, IMAGES = 6, 3, ("img/red.png", "img/green.png")


def _rows(shape: str) -> list[dict]:
    """Each question asked of each image, with three answers (pairs, samples) per question and image."""
    rows = []
    for q in range(QUESTIONS):
        for image in IMAGES:
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Q{q}?"}]}]
            for a in range(ANSWERS):
                answer = [{"role": "assistant", "content": f"answer {a}"}]
                if shape == "sft":
                    row = {"messages": prompt + answer}
                elif shape == "sft_completion":
                    row = {"prompt": prompt, "completion": answer}
                elif shape == "preference":
                    row = {"prompt": prompt, "chosen": answer, "rejected": f"wrong {a}"}
                else:
                    row = {"prompt": prompt, "solution": f"s{a}"}
                rows.append({**row, "images": [image]})
    return rows


def _prompts(dataset) -> list[tuple[str, str]]:
    """(question, image) of each row: the question is the first turn's text, before any answer."""
    out = []
    for row in dataset.normalized():
        turn = (row["messages"] if "messages" in row else row["prompt"])[0]
        out.append((turn["content"][-1]["text"], row["images"][0]))
    return out


@pytest.mark.parametrize("shape", ["sft", "sft_completion", "preference", "prompt"])
def test_val_fraction_holds_out_whole_prompts(folder, shape, caplog):  # noqa: F811
    # Held out row by row, about half of the validation rows' prompts were also trained on.
    module = MODULES["sft" if shape.startswith("sft") else shape]
    dm = module(train=write(folder, "jsonl", _rows(shape)), val_fraction=0.25, shuffle=False)
    with caplog.at_level(logging.INFO, logger="lightning_vlm.data"):
        dm.setup()
    train, val = _prompts(dm.train_dataset), _prompts(dm.val_dataset)
    assert not set(train) & set(val)
    groups = QUESTIONS * len(IMAGES)
    assert len(val) == ANSWERS * round(0.25 * groups) and len(train) + len(val) == ANSWERS * groups
    # The same question about another image is another prompt: both images' rows are in validation.
    assert {image for _, image in val} == {str(folder / i) for i in IMAGES}
    assert f"{ANSWERS * groups} rows share {groups} prompts" in caplog.text


def test_val_fraction_of_distinct_prompts_holds_out_that_many_rows():
    dm = PromptDataModule(train={"path": "synthetic", "num_samples": 10}, val_fraction=0.3, seed=1)
    dm.setup()
    train, val = dm.train_dataset.indices, dm.val_dataset.indices
    assert len(val) == 3 and len(train) == 7 and not set(train) & set(val)
