"""Synthetic visual questions for the answer rewards: counting, multiple choice, reading, measuring.

Kinds of the built-in task beyond colour and shape (``data.synthetic.kinds``), each scored by one of the
rewards of ``rewards/answers.py``, ``choices.py`` and ``ocr.py``:

- ``count_cells``: one to three shapes, each in its own cell of a 2 x 2 grid, "How many shapes are
  there?" -> one..three, ``count_reward`` (synthetic.py's ``count``, whose single shape may span cells,
  stayed at chance for the tiny models);
- ``choice``: the colour question with the eight colours as lettered options A-H -> the letter,
  ``multiple_choice_reward``;
- ``text``: a colour name written in dark ink on a light background, "What word is written?" -> the
  word, ``ocr_reward`` (partial credit for near misses);
- ``size``: one shape, "How wide is the shape in pixels?" -> its width, ``numeric_reward`` with a
  tolerance.

Each prompt row carries its kind as ``task``, so one run can mix kinds and give each its reward
(``rewards.TaskReward``). Samples are ``synthetic.Sample``s, so the SFT, preference, prompt and unpaired
row builders of ``synthetic.py`` serve them. The question words stay out of the tiny tokenizer's
``VOCABULARY`` on purpose: adding them would change every tiny model and every figure measured on them.

Sized for the tiny models, which cannot bind or read much (measured, 600 SFT steps of tiny Idefics3,
greedy accuracy at chance): the options come in one fixed order (with four shuffled options per row it
stayed at 0.25: the model must then match the image's colour to a word in the prompt and copy the
letter before it), and the word is written near the centre in large type (placed anywhere at a quarter
of the image's height, it stayed at 1/8).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from lightning_vlm.data.synthetic import (
    BACKGROUNDS,
    COLORS,
    COUNTS,
    QUESTIONS,
    SHAPES,
    Sample,
    _draw_shape,
    make_sample,
)

# The kinds this module draws itself; synthetic.py's (colour, shape, count) mix with them.
VQA_QUESTIONS: dict[str, str] = {
    "count_cells": "How many shapes are there?",
    "choice": "What color is the shape?",
    "text": "What word is written?",
    "size": "How wide is the shape in pixels?",
}
KINDS: tuple[str, ...] = (*QUESTIONS, *VQA_QUESTIONS)
LETTERS = "ABCDEFGH"
# Widths of the size task as fractions of the image: large enough to be seen after patching, small
# enough to leave room to move the shape around.
SIZE_RANGE = (1 / 7, 6 / 7)
# Text kind: the ink and the light backgrounds it is written on.
INK: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (60, 60, 60))
PAPER: tuple[tuple[int, int, int], ...] = ((255, 255, 255), (200, 200, 200))


def check_kinds(kinds: Sequence[str]) -> None:
    """Raise naming the unknown kinds and the known ones (grounding is a task of its own, ``grounding.py``)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"unknown synthetic question kinds {unknown or list(kinds)}; expected some of {KINDS} "
            "(or kinds=[grounding] alone)"
        )


def _choice(rng: random.Random, image_size: int) -> tuple[Image.Image, str, str, str]:
    color = rng.choice(tuple(COLORS))
    shape = rng.choice(SHAPES)
    background = rng.choice([b for b in BACKGROUNDS if b != COLORS[color]])
    options = list(COLORS)
    image = Image.new("RGB", (image_size, image_size), background)
    size = rng.randint(image_size // 3, image_size * 2 // 3)
    x0, y0 = rng.randint(0, image_size - size), rng.randint(0, image_size - size)
    _draw_shape(ImageDraw.Draw(image), shape, (x0, y0, x0 + size, y0 + size), COLORS[color])
    listed = "\n".join(f"{letter}. {option}" for letter, option in zip(LETTERS, options, strict=True))
    question = f"{VQA_QUESTIONS['choice']}\n{listed}\nAnswer with the letter."
    answer = LETTERS[options.index(color)]
    return image, question, answer, rng.choice([x for x in LETTERS if x != answer])


def _text(rng: random.Random, image_size: int) -> tuple[Image.Image, str, str, str]:
    word = rng.choice(tuple(COLORS))
    image = Image.new("RGB", (image_size, image_size), rng.choice(PAPER))
    draw = ImageDraw.Draw(image)
    # Pillow's built-in scalable font: the same glyphs on every machine with this Pillow, no font files.
    font = ImageFont.load_default(size=max(8, image_size * 2 // 7))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    # Centred, give or take a sixteenth of the image.
    jitter = image_size // 16
    x = (image_size - (right - left)) // 2 - left + rng.randint(-jitter, jitter)
    y = (image_size - (bottom - top)) // 2 - top + rng.randint(-jitter, jitter)
    ink = rng.choice(INK)
    # A one-pixel stroke: the thin glyphs of small type are mostly anti-aliased grey, not ink.
    draw.text((x, y), word, fill=ink, font=font, stroke_width=1, stroke_fill=ink)
    return image, VQA_QUESTIONS["text"], word, rng.choice([c for c in COLORS if c != word])


def _size(rng: random.Random, image_size: int) -> tuple[Image.Image, str, str, str]:
    color = rng.choice(tuple(COLORS))
    background = rng.choice([b for b in BACKGROUNDS if b != COLORS[color]])
    low, high = (round(f * image_size) for f in SIZE_RANGE)
    width = rng.randint(low, high)
    image = Image.new("RGB", (image_size, image_size), background)
    x0, y0 = rng.randint(0, image_size - width), rng.randint(0, image_size - width)
    # PIL's shape boxes include their right and bottom pixel: this box is exactly `width` pixels wide.
    box = (x0, y0, x0 + width - 1, y0 + width - 1)
    _draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), box, COLORS[color])
    # The rejected answer is off by a quarter of the range or more, past any sensible tolerance.
    far = [w for w in range(low, high + 1) if abs(w - width) >= (high - low) // 4]
    return image, VQA_QUESTIONS["size"], str(width), str(rng.choice(far))


def _count_cells(rng: random.Random, image_size: int) -> tuple[Image.Image, str, str, str]:
    color = rng.choice(tuple(COLORS))
    background = rng.choice([b for b in BACKGROUNDS if b != COLORS[color]])
    count = rng.randint(1, len(COUNTS))
    image = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(image)
    half = image_size // 2
    for cell in rng.sample(range(4), count):
        size = rng.randint(half * 2 // 3, half - 2)
        x0 = (cell % 2) * half + rng.randint(0, half - size)
        y0 = (cell // 2) * half + rng.randint(0, half - size)
        # PIL's boxes include their right and bottom pixel: this one ends a pixel inside its cell, so that
        # shapes of neighbouring cells (one colour) never touch and read as one.
        _draw_shape(draw, rng.choice(SHAPES), (x0, y0, x0 + size - 2, y0 + size - 2), COLORS[color])
    answer = COUNTS[count - 1]
    return image, VQA_QUESTIONS["count_cells"], answer, rng.choice([w for w in COUNTS if w != answer])


_DRAW = {"count_cells": _count_cells, "choice": _choice, "text": _text, "size": _size}


def make_vqa_sample(seed: int, index: int, kinds: Sequence[str], image_size: int = 112) -> Sample:
    """Sample ``index`` of a task mixing ``kinds`` (any of ``KINDS``), seeded by ``seed``; deterministic.

    The kind is drawn from a stream of its own; colour, shape and count samples are synthetic.py's
    ``make_sample`` for that one kind.
    """
    check_kinds(kinds)
    # A string seed keeps these streams apart from synthetic.py's for the same (seed, index).
    rng = random.Random(f"vqa/{seed}/{index}")
    kind = kinds[rng.randrange(len(kinds))]
    if kind in QUESTIONS:
        return make_sample(seed, index, (kind,), image_size)
    image, question, answer, wrong = _DRAW[kind](rng, image_size)
    return Sample(image=image, kind=kind, question=question, answer=answer, wrong_answer=wrong)
