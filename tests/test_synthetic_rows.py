"""The synthetic task's rows (held out by role, settings that cannot draw, shapes that can be counted) and
rows that loaded, then trained wrongly."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlm.data import RowError, SFTDataModule, SourceError, normalize_row

SMALL = {"num_train": 6, "num_val": 4, "image_size": 32}


@pytest.mark.parametrize(("split", "val_split"), [("test", "validation"), ("train", "train")])
def test_synthetic_validation_is_held_out_whatever_the_splits_are_named(split, val_split):
    # The seed follows the rows' role: named "test", training rows drew the validation seed (every row
    # validated was trained on), and a validation split named "train" drew the training seed.
    dm = SFTDataModule(synthetic=SMALL, split=split, val_split=val_split, shuffle=False)
    dm.setup()
    train = {np.asarray(dm.train_dataset[i]["images"][0]).tobytes() for i in range(len(dm.train_dataset))}
    val = {np.asarray(dm.val_dataset[i]["images"][0]).tobytes() for i in range(len(dm.val_dataset))}
    assert len(train) == 6 and len(val) == 4 and not train & val


@pytest.mark.parametrize(
    ("synthetic", "message"),
    [
        ({"kinds": []}, "data.synthetic.kinds is empty"),
        # sample 0 drew a colour question, which fits 12 pixels: the count question failed mid-run
        ({"kinds": ["color", "count"], "image_size": 12}, "image_size must be an integer >= 16.*got 12"),
        ({"image_size": 0}, "got 0"),
    ],
)
def test_synthetic_settings_that_cannot_draw_are_refused_naming_them(synthetic, message):
    with pytest.raises(ValueError, match=message):
        SFTDataModule(synthetic={**SMALL, **synthetic}).setup()


def test_a_slice_of_the_synthetic_task_is_refused_not_ignored():
    with pytest.raises(SourceError, match=r"no splits to slice, got split 'train\[:80%\]'.*num_train"):
        SFTDataModule(synthetic=SMALL, split="train[:80%]").setup()


def _blobs(mask: np.ndarray) -> int:
    """Connected groups of True pixels, neighbours including diagonals."""
    seen, blobs = np.zeros_like(mask), 0
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        blobs, stack = blobs + 1, [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    q = (y + dy, x + dx)
                    if 0 <= q[0] < mask.shape[0] and 0 <= q[1] < mask.shape[1] and mask[q] and not seen[q]:
                        seen[q] = True
                        stack.append(q)
    return blobs


@pytest.mark.parametrize("kind", ["count", "count_cells"])
def test_counted_shapes_never_touch(kind):
    # Drawn to their box's right and bottom pixel, a cell's shape reached into the next cell, where another
    # shape could start (count: 43 of 2688 samples with several shapes), or touched it (count_cells: 66):
    # two shapes of one colour read as one.
    from lightning_vlm.data.synthetic import COLORS, COUNTS, make_sample
    from lightning_vlm.data.vqa import make_vqa_sample

    draw = make_sample if kind == "count" else make_vqa_sample
    checked = 0
    for index in range(1500):
        sample = draw(0, index, (kind,), 32)
        count = COUNTS.index(sample.answer) + 1
        if count == 1:
            continue
        pixels = np.asarray(sample.image)
        # the shapes' colour: the one colour in the image that is not its background (the corner pixel)
        colours = {tuple(c) for c in pixels.reshape(-1, 3)} - {tuple(pixels[0, 0])}
        if tuple(pixels[0, 0]) in COLORS.values():  # a shape covers the corner: read the colour elsewhere
            continue
        (colour,) = colours
        assert _blobs((pixels == colour).all(axis=2)) == count, f"sample {index}: {sample.answer}"
        checked += 1
    assert checked > 500


def test_a_preference_pair_whose_answers_are_the_same_is_a_bad_row():
    # With an explicit prompt it loaded: DPO's loss is a constant there, and KTO got the same answer twice,
    # once desirable and once not
    with pytest.raises(RowError, match=r"row 0, column 'chosen'.*the same answer"):
        normalize_row({"prompt": "q", "chosen": "same", "rejected": "same"}, "preference")
