"""The built-in synthetic visual task: coloured shapes on a plain background.

Deterministic from a seed, checkable answers (colour, shape, count), offered in the three data
shapes the methods consume (SFT, preference, prompt). Every answer word is a single token of the
tiny models' tokenizers (see ``VOCABULARY``), so one generated token decides correctness.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
    "pink": (250, 140, 190),
    "cyan": (40, 210, 220),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
COUNTS: tuple[str, ...] = ("one", "two", "three")
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (128, 128, 128), (255, 255, 255))

# The built-in task's settings (the DataModules' ``synthetic=``; a partial mapping keeps the rest). seed 0:
# the same rows whatever the run's seed (which still orders them and draws the weights); None: the
# DataModule's `seed`.
SYNTHETIC_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {"num_train": 4096, "num_val": 128, "seed": 0, "kinds": ("color",), "image_size": 112}
)

QUESTIONS: dict[str, str] = {
    "color": "What color is the shape?",
    "shape": "What shape is shown?",
    "count": "How many shapes are there?",
}
ANSWERS: dict[str, tuple[str, ...]] = {"color": tuple(COLORS), "shape": SHAPES, "count": COUNTS}

# Words the tiny tokenizers must keep whole: every answer and every question word.
VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [w for answers in ANSWERS.values() for w in answers]
        + [w.strip("?").lower() for q in QUESTIONS.values() for w in q.split()]
    )
)


@dataclass(frozen=True)
class Sample:
    """One task instance: an image, its question and the single-word answer."""

    image: Image.Image
    kind: str
    question: str
    answer: str
    wrong_answer: str


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "diamond":
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def make_sample(seed: int, index: int, kinds: Sequence[str] = ("color",), image_size: int = 112) -> Sample:
    """Build sample ``index`` of the task seeded by ``seed``; the same arguments give the same sample."""
    for kind in kinds:
        if kind not in QUESTIONS:
            raise ValueError(f"unknown synthetic question kind {kind!r}; expected some of {tuple(QUESTIONS)}")
    rng = random.Random(seed * 1_000_003 + index)
    kind = kinds[rng.randrange(len(kinds))]
    color = rng.choice(tuple(COLORS))
    shape = rng.choice(SHAPES)
    count = rng.randrange(len(COUNTS)) + 1 if kind == "count" else 1
    background = rng.choice([b for b in BACKGROUNDS if b != COLORS[color]])

    image = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(image)
    # Shapes of one image share colour and kind; several are drawn in separate grid cells so that
    # counting is well defined: PIL's box includes its right and bottom pixels, so a cell's shape ends
    # 2 pixels inside its box, leaving the cell's last row and column empty. Two shapes never touch.
    cells = rng.sample(range(4), count) if count > 1 else [None]
    for cell in cells:
        if cell is None:
            size = rng.randint(image_size // 3, image_size * 2 // 3)
            x0 = rng.randint(0, image_size - size)
            y0 = rng.randint(0, image_size - size)
            box = (x0, y0, x0 + size, y0 + size)
        else:
            half = image_size // 2
            size = rng.randint(half // 2, half - 4)
            x0 = (cell % 2) * half + rng.randint(0, half - size)
            y0 = (cell // 2) * half + rng.randint(0, half - size)
            box = (x0, y0, x0 + size - 2, y0 + size - 2)
        _draw_shape(draw, shape, box, COLORS[color])

    answer = {"color": color, "shape": shape, "count": COUNTS[count - 1]}[kind]
    wrong = rng.choice([a for a in ANSWERS[kind] if a != answer])
    return Sample(image=image, kind=kind, question=QUESTIONS[kind], answer=answer, wrong_answer=wrong)


def _user_turn(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _assistant_turn(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def as_sft_row(sample: Sample) -> dict:
    """TRL's conversational SFT row: ``messages`` + ``images``."""
    return {
        "messages": _user_turn(sample.question) + _assistant_turn(sample.answer),
        "images": [sample.image],
    }


def as_preference_row(sample: Sample) -> dict:
    """TRL's conversational preference row: ``prompt``, ``chosen``, ``rejected``, ``images``."""
    return {
        "prompt": _user_turn(sample.question),
        "chosen": _assistant_turn(sample.answer),
        "rejected": _assistant_turn(sample.wrong_answer),
        "images": [sample.image],
    }


def as_prompt_row(sample: Sample) -> dict:
    """TRL's conversational prompt row: ``prompt``, ``images``, and for rewards the ``solution`` and the
    question's kind as ``task`` (``rewards.TaskReward`` routes a reward to one task's rows)."""
    return {"prompt": _user_turn(sample.question), "images": [sample.image], "solution": sample.answer,
            "task": sample.kind}  # fmt: skip


def as_unpaired_row(sample: Sample, desirable: bool = True) -> dict:
    """TRL's unpaired (KTO) row: ``prompt``, ``completion``, ``label``, ``images``; the right answer when
    ``desirable``, else the wrong one. ``solution`` (the right answer) is kept for answer accuracy."""
    answer = sample.answer if desirable else sample.wrong_answer
    return {"prompt": _user_turn(sample.question), "completion": _assistant_turn(answer), "label": desirable,
            "images": [sample.image], "solution": sample.answer}  # fmt: skip


ROW_BUILDERS = {"sft": as_sft_row, "preference": as_preference_row, "prompt": as_prompt_row,
                "unpaired": as_unpaired_row}  # fmt: skip


def build_row(shape: str, sample: Sample, index: int) -> dict:
    """Row ``index`` in ``shape``; unpaired rows alternate desirable (even) and undesirable (odd), so no
    prompt appears with both labels (KTO's data is unpaired)."""
    if shape == "unpaired":
        return as_unpaired_row(sample, desirable=index % 2 == 0)
    return ROW_BUILDERS[shape](sample)


def synthetic_rows(
    shape: str, num_samples: int, seed: int = 0, kinds: Sequence[str] = ("color",), image_size: int = 112
) -> list[dict]:
    """``num_samples`` rows of the task in one of the data shapes ``sft``, ``preference`` or ``prompt``."""
    if shape not in ROW_BUILDERS:
        raise ValueError(f"unknown data shape {shape!r}; expected one of {tuple(ROW_BUILDERS)}")
    return [build_row(shape, make_sample(seed, i, kinds, image_size), i) for i in range(num_samples)]
