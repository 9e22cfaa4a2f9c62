"""The synthetic grounding task: deterministic, boxes match the drawn pixels, rows in the three shapes."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlm.data.grounding import box_text, grounding_rows, make_grounding_sample
from lightning_vlm.data.synthetic import BACKGROUNDS, COLORS
from lightning_vlm.rewards.boxes import giou_reward, iou_reward, parse_box


def _pixel_box(image, color: str) -> tuple[int, int, int, int] | None:
    """The edge box (right and bottom exclusive) of the pixels of exactly this colour."""
    mask = (np.asarray(image) == np.array(COLORS[color], dtype=np.uint8)).all(axis=-1)
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)


def test_samples_are_deterministic_and_vary():
    a, b = make_grounding_sample(3, 5), make_grounding_sample(3, 5)
    assert a.answer == b.answer and a.question == b.question and a.distractor_box == b.distractor_box
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    answers = {make_grounding_sample(3, i).answer for i in range(30)}
    assert len(answers) > 3
    other_seed = [make_grounding_sample(4, i).answer for i in range(10)]
    assert other_seed != [make_grounding_sample(3, i).answer for i in range(10)]


@pytest.mark.parametrize(("image_size", "grid"), [(96, 3), (64, 4), (100, 3)])
def test_box_is_the_target_pixels_and_the_distractor_is_elsewhere(image_size, grid):
    cell = image_size // grid
    shapes = set()
    for index in range(24):
        sample = make_grounding_sample(0, index, image_size, grid, distractor=True)
        shapes.add(sample.shape)
        x1, y1, x2, y2 = sample.box
        assert x2 - x1 == cell and y2 - y1 == cell and x1 % cell == 0 and y1 % cell == 0
        assert sample.image.size == (image_size, image_size)
        # Every shape touches all four sides of its cell, so its pixels span exactly the box.
        assert _pixel_box(sample.image, sample.color) == sample.box
        assert _pixel_box(sample.image, sample.distractor_color) == sample.distractor_box
        assert sample.distractor_box != sample.box and sample.distractor_color != sample.color
        assert sample.question == f"Where is the {sample.color} shape?"
        assert sample.answer == box_text(sample.box) == "[{}, {}, {}, {}]".format(*sample.box)
    assert len(shapes) > 1


def test_the_built_in_task_draws_the_target_alone():
    sample = make_grounding_sample(0, 0)
    assert _pixel_box(sample.image, sample.color) == sample.box
    # the distractor cell stays empty (it is still the preference rows' rejected box)
    assert _pixel_box(sample.image, sample.distractor_color) is None


def test_background_differs_from_both_colours():
    for index in range(20):
        sample = make_grounding_sample(1, index, distractor=True)
        pixels = {tuple(p) for p in np.asarray(sample.image).reshape(-1, 3)}
        # Background, target, distractor and nothing else (no blended edges).
        background = pixels - {COLORS[sample.color], COLORS[sample.distractor_color]}
        assert len(pixels) == 3 and len(background) == 1 and background <= set(BACKGROUNDS)


def test_answers_score_full_iou_and_the_distractor_scores_zero():
    samples = [make_grounding_sample(2, i) for i in range(16)]
    solutions = [s.answer for s in samples]
    assert iou_reward(solutions, solutions) == [1.0] * 16
    assert giou_reward(solutions, solutions) == [1.0] * 16
    assert iou_reward([s.wrong_answer for s in samples], solutions) == [0.0] * 16
    assert all(parse_box(s.answer) == s.box for s in samples)


def test_rows_in_the_three_shapes():
    sft, prompt, preference = (grounding_rows(shape, 3, seed=1) for shape in ("sft", "prompt", "preference"))
    assert all(set(r) == {"messages", "images"} for r in sft)
    assert all(
        set(r) == {"prompt", "images", "solution", "task"} and r["task"] == "grounding" for r in prompt
    )
    assert all(set(r) == {"prompt", "chosen", "rejected", "images"} for r in preference)
    sample = make_grounding_sample(1, 0)
    assert sft[0]["messages"][0]["content"][1]["text"] == sample.question
    assert sft[0]["messages"][1]["content"][0]["text"] == sample.answer
    assert prompt[0]["solution"] == sample.answer
    assert preference[0]["chosen"][0]["content"][0]["text"] == sample.answer
    assert preference[0]["rejected"][0]["content"][0]["text"] == sample.wrong_answer
    assert [r["solution"] for r in prompt] == [make_grounding_sample(1, i).answer for i in range(3)]
    assert len(sft[0]["images"]) == 1 and sft[0]["images"][0].size == (56, 56)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown data shape 'chat'"):
        grounding_rows("chat", 2)
    with pytest.raises(ValueError, match="grid >= 2"):
        make_grounding_sample(0, 0, grid=1)
    with pytest.raises(ValueError, match="too small"):
        make_grounding_sample(0, 0, image_size=20, grid=3)
