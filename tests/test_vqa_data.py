"""The answer-reward kinds of the synthetic task (data/vqa.py): deterministic, answers true to the drawn
image, scored 1 by their rewards (and the rejected answers 0), mixed with the classic kinds in one stream."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlm.data.sources import synthetic_source
from lightning_vlm.data.synthetic import COLORS, make_sample
from lightning_vlm.data.vqa import INK, KINDS, LETTERS, VQA_QUESTIONS, make_vqa_sample
from lightning_vlm.rewards import count_reward, multiple_choice_reward, numeric_reward, ocr_reward

REWARDS = {
    "count": count_reward,
    "count_cells": count_reward,
    "choice": multiple_choice_reward,
    "text": ocr_reward,
    "size": lambda c, solution: numeric_reward(c, solution, abs_tol=8),
}


def _samples(kind: str, n: int = 24, seed: int = 0):
    return [make_vqa_sample(seed, i, (kind,)) for i in range(n)]


def _mask(image, rgb) -> np.ndarray:
    return (np.asarray(image) == np.array(rgb, dtype=np.uint8)).all(axis=-1)


def test_samples_are_deterministic_and_vary():
    for kind in ("count_cells", "choice", "text", "size"):
        a, b = make_vqa_sample(3, 5, (kind,)), make_vqa_sample(3, 5, (kind,))
        assert (a.question, a.answer, a.wrong_answer) == (b.question, b.answer, b.wrong_answer)
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
        assert len({s.answer for s in _samples(kind)}) >= 3
        assert [s.answer for s in _samples(kind, 10, seed=4)] != [s.answer for s in _samples(kind, 10)]


def test_choice_lists_the_colours_and_the_answer_letter_names_the_drawn_one():
    for sample in _samples("choice"):
        lines = sample.question.split("\n")
        assert lines[0] == VQA_QUESTIONS["choice"] and lines[-1] == "Answer with the letter."
        options = dict(line.split(". ") for line in lines[1:-1])
        # the eight colours, in one fixed order (see the module's note on what tiny models can learn)
        assert list(options) == list(LETTERS) and list(options.values()) == list(COLORS)
        drawn = [c for c in COLORS if _mask(sample.image, COLORS[c]).any()]
        assert drawn == [options[sample.answer]]
        assert sample.wrong_answer in LETTERS and sample.wrong_answer != sample.answer


def test_text_writes_the_answer_word_in_ink():
    for sample in _samples("text"):
        assert sample.question == VQA_QUESTIONS["text"] and sample.answer in COLORS
        assert sample.wrong_answer in COLORS and sample.wrong_answer != sample.answer
        ink = sum(_mask(sample.image, rgb).sum() for rgb in INK)
        # Glyphs are anti-aliased: some pixels are pure ink, none of the shape colours appear.
        assert ink > 20
        assert not any(_mask(sample.image, rgb).any() for rgb in COLORS.values())
    # different words leave different ink, the same word the same ink at the same place
    inks = {
        s.answer: _mask(s.image, INK[0]).sum() + _mask(s.image, INK[1]).sum() for s in _samples("text", 40)
    }
    assert len(set(inks.values())) > 4


def test_size_answer_is_the_drawn_width_in_pixels():
    widths = set()
    for sample in _samples("size", 40):
        (color,) = [c for c in COLORS if _mask(sample.image, COLORS[c]).any()]
        xs = np.nonzero(_mask(sample.image, COLORS[color]).any(axis=0))[0]
        assert xs.max() - xs.min() + 1 == int(sample.answer)
        assert abs(int(sample.wrong_answer) - int(sample.answer)) >= 20
        widths.add(int(sample.answer))
    assert min(widths) >= 16 and max(widths) <= 96 and len(widths) > 20


def test_count_cells_draws_one_shape_per_counted_cell():
    counts = set()
    for sample in _samples("count_cells", 40):
        (color,) = [c for c in COLORS if _mask(sample.image, COLORS[c]).any()]
        mask = _mask(sample.image, COLORS[color])
        half = mask.shape[0] // 2
        cells = [
            mask[r * half : (r + 1) * half, c * half : (c + 1) * half].any() for r in (0, 1) for c in (0, 1)
        ]
        assert ["one", "two", "three"][sum(cells) - 1] == sample.answer != sample.wrong_answer
        counts.add(sample.answer)
    assert counts == {"one", "two", "three"}


def test_count_is_the_classic_count_sample():
    sample = make_vqa_sample(2, 7, ("count",))
    classic = make_sample(2, 7, ("count",))
    assert (sample.question, sample.answer) == (classic.question, classic.answer)
    assert np.array_equal(np.asarray(sample.image), np.asarray(classic.image))


@pytest.mark.parametrize("kind", list(REWARDS))
def test_answers_score_1_and_rejected_answers_0(kind):
    samples = _samples(kind)
    solutions = [s.answer for s in samples]
    assert REWARDS[kind](solutions, solution=solutions) == [1.0] * len(samples)
    wrong = REWARDS[kind]([s.wrong_answer for s in samples], solution=solutions)
    assert all(w < (1.0 if kind == "text" else 0.5) for w in wrong)  # OCR gives partial credit


def test_mixed_prompt_rows_carry_their_task_and_classic_kinds_keep_their_stream():
    kinds = ["count", "count_cells", "choice", "text", "size", "color"]
    rows = synthetic_source("prompt", num_samples=40, kinds=kinds).rows
    assert {r["task"] for r in rows} == set(kinds)
    for i, row in enumerate(rows):
        sample = make_vqa_sample(0, i, kinds)
        assert row["solution"] == sample.answer and row["task"] == sample.kind
    classic = synthetic_source("prompt", num_samples=6, kinds=["color", "count"]).rows
    assert [r["solution"] for r in classic] == [
        make_sample(0, i, ("color", "count")).answer for i in range(6)
    ]
    sft = synthetic_source("sft", num_samples=4, kinds=["size"]).rows
    assert sft[0]["messages"][1]["content"][0]["text"] == make_vqa_sample(0, 0, ["size"]).answer


def test_unknown_kinds_name_every_known_one():
    with pytest.raises(ValueError, match=r"unknown synthetic question kinds \['colour'\].*'choice'.*'size'"):
        synthetic_source("prompt", kinds=["choice", "colour"])
    assert set(KINDS) == {"color", "shape", "count", "count_cells", "choice", "text", "size"}
