"""The synthetic grounding task: find the box of the shape of a named colour.

A ``grid`` x ``grid`` layout of square cells; the target shape fills one cell (and, with
``distractor``, a shape of another colour fills another) on a background of neither colour. The
question names the target's colour, the answer is the target cell's box in pixels as text,
``"[x1, y1, x2, y2]"``, which ``iou_reward`` / ``giou_reward`` score against the ``solution``.
Deterministic from a seed, in the three data shapes of ``synthetic.py`` (SFT, preference, prompt).

The built-in task (``data.synthetic.kinds=[grounding]``) is 2 x 2 cells on 56-pixel images, without a
distractor: the tiny models learn to localise one shape (measured, tiny Idefics3: greedy exact boxes
0.33 -> 0.58 in 300 SFT steps), but not yet to bind a colour to one of two shapes (0.33 -> 0.38 in
400 steps). The preference rows' rejected box is the distractor's cell, drawn or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from lightning_vlm.data.synthetic import (
    BACKGROUNDS,
    COLORS,
    SHAPES,
    _assistant_turn,
    _draw_shape,
    _user_turn,
)

PixelBox = tuple[int, int, int, int]

# Below this a cell is too small for a shape to be recognisable after the vision encoder's patching.
MIN_CELL = 8


@dataclass(frozen=True)
class GroundingSample:
    """One grounding instance: the image, its question, the target's box (and as answer text), the distractor's."""

    image: Image.Image
    question: str
    answer: str
    box: PixelBox
    color: str
    shape: str
    distractor_box: PixelBox
    distractor_color: str
    wrong_answer: str


def box_text(box: PixelBox) -> str:
    """A pixel box as the answer text the task expects: ``"[x1, y1, x2, y2]"``."""
    return "[" + ", ".join(str(v) for v in box) + "]"


def cell_box(cell: int, grid: int, cell_size: int) -> PixelBox:
    """The box of cell ``cell`` (row-major) of the grid, edges in pixels: right and bottom exclusive."""
    row, col = divmod(cell, grid)
    return (col * cell_size, row * cell_size, (col + 1) * cell_size, (row + 1) * cell_size)


def make_grounding_sample(
    seed: int, index: int, image_size: int = 56, grid: int = 2, distractor: bool = False
) -> GroundingSample:
    """Build sample ``index`` of the grounding task seeded by ``seed``; the same arguments give the same sample.

    The box is the target's cell, ``[col*cell, row*cell, (col+1)*cell, (row+1)*cell]`` with
    ``cell = image_size // grid``, which is the exact pixel extent of the drawn shape: every shape
    touches all four sides of its cell. When ``grid`` does not divide ``image_size`` the leftover
    stripe on the right and bottom stays background.
    """
    if grid < 2:
        raise ValueError(f"grounding needs grid >= 2 (a target and a distractor cell); got {grid}")
    cell_size = image_size // grid
    if cell_size < MIN_CELL:
        raise ValueError(
            f"grounding cells of image_size // grid = {cell_size} pixels are too small; "
            f"need at least {MIN_CELL} (image_size >= {MIN_CELL * grid} for grid={grid})"
        )
    # A string seed keeps this stream apart from synthetic.py's for the same (seed, index).
    rng = random.Random(f"grounding/{seed}/{index}")
    color, distractor_color = rng.sample(tuple(COLORS), 2)
    shape, distractor_shape = rng.choice(SHAPES), rng.choice(SHAPES)
    target_cell, distractor_cell = rng.sample(range(grid * grid), 2)
    background = rng.choice([b for b in BACKGROUNDS if b not in (COLORS[color], COLORS[distractor_color])])

    image = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(image)
    box = cell_box(target_cell, grid, cell_size)
    distractor_box = cell_box(distractor_cell, grid, cell_size)
    drawn = [(shape, box, color), (distractor_shape, distractor_box, distractor_color)]
    for drawn_shape, drawn_box, drawn_color in drawn[: 2 if distractor else 1]:
        # PIL's shape boxes include their right and bottom pixel; the cell's edges exclude them.
        x1, y1, x2, y2 = drawn_box
        _draw_shape(draw, drawn_shape, (x1, y1, x2 - 1, y2 - 1), COLORS[drawn_color])

    return GroundingSample(
        image=image,
        question=f"Where is the {color} shape?",
        answer=box_text(box),
        box=box,
        color=color,
        shape=shape,
        distractor_box=distractor_box,
        distractor_color=distractor_color,
        wrong_answer=box_text(distractor_box),
    )


def as_sft_row(sample: GroundingSample) -> dict:
    """TRL's conversational SFT row: ``messages`` + ``images``."""
    return {
        "messages": _user_turn(sample.question) + _assistant_turn(sample.answer),
        "images": [sample.image],
    }


def as_preference_row(sample: GroundingSample) -> dict:
    """TRL's conversational preference row; the rejected answer is the distractor's box."""
    return {
        "prompt": _user_turn(sample.question),
        "chosen": _assistant_turn(sample.answer),
        "rejected": _assistant_turn(sample.wrong_answer),
        "images": [sample.image],
    }


def as_prompt_row(sample: GroundingSample) -> dict:
    """TRL's conversational prompt row: ``prompt``, ``images``, the box text as ``solution`` and ``task``."""
    return {"prompt": _user_turn(sample.question), "images": [sample.image], "solution": sample.answer,
            "task": "grounding"}  # fmt: skip


ROW_BUILDERS = {"sft": as_sft_row, "preference": as_preference_row, "prompt": as_prompt_row}


def grounding_rows(
    shape: str, num_samples: int, seed: int = 0, image_size: int = 56, grid: int = 2
) -> list[dict]:
    """``num_samples`` rows of the grounding task in one of the data shapes ``sft``, ``preference`` or ``prompt``."""
    if shape not in ROW_BUILDERS:
        raise ValueError(f"unknown data shape {shape!r}; expected one of {tuple(ROW_BUILDERS)}")
    build = ROW_BUILDERS[shape]
    return [build(make_grounding_sample(seed, i, image_size, grid)) for i in range(num_samples)]
