"""Rows that mix TRL's two message forms: a plain-string prompt with typed (block) answers.

Converted datasets often store the question as a string and the answers as conversations of blocks.
The images go first in the plain prompt's user turn, as TRL decides per message; the answers' form
says nothing about where the prompt's images are. A prompt written as blocks places its own images.
"""

from __future__ import annotations

import pytest
from PIL import Image

from lightning_vlm.data import normalize_row
from lightning_vlm.data.rows import RowError

IMG = {"type": "image"}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def said(answer: str) -> list[dict]:
    """An assistant turn written as blocks."""
    return [{"role": "assistant", "content": [text(answer)]}]


@pytest.fixture
def image():
    return Image.new("RGB", (8, 8), (200, 30, 30))


def test_a_plain_prompt_takes_the_images_whatever_form_the_answers_take(image):
    out = normalize_row({"prompt": "Colour?", "completion": said("red"), "images": [image]}, "sft")
    assert [m["content"] for m in out["messages"]] == [[IMG, text("Colour?")], [text("red")]]

    out = normalize_row(
        {"prompt": "Colour?", "chosen": said("red"), "rejected": said("blue"), "images": [image]},
        "preference",
    )
    assert out["prompt"] == [{"role": "user", "content": [IMG, text("Colour?")]}]
    assert out["chosen"] == said("red") and out["rejected"] == said("blue")

    row = {"prompt": "Colour?", "completion": said("red"), "label": True, "images": [image]}
    out = normalize_row(row, "unpaired")
    assert out["prompt"] == [{"role": "user", "content": [IMG, text("Colour?")]}]

    # the implicit-prompt form: a plain shared prefix, typed answers after it
    question = {"role": "user", "content": "Colour?"}
    row = {"chosen": [question, *said("red")], "rejected": [question, *said("blue")], "images": [image]}
    out = normalize_row(row, "preference")
    assert out["prompt"] == [{"role": "user", "content": [IMG, text("Colour?")]}]


def test_a_prompt_written_as_blocks_places_its_own_images(image):
    typed = [{"role": "user", "content": [text("Colour?"), IMG]}]
    out = normalize_row({"prompt": typed, "completion": "red", "images": [image]}, "sft")
    assert out["messages"][0]["content"] == [text("Colour?"), IMG]  # left where the row put it
    # blocks without an image block: the row says where images go, and it says nowhere
    typed = [{"role": "user", "content": [text("Colour?")]}]
    with pytest.raises(RowError, match="0 \\{'type': 'image'\\} block\\(s\\) in the messages but 1 image"):
        normalize_row({"prompt": typed, "completion": "red", "images": [image]}, "sft")
