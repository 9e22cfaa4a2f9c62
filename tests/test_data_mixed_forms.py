"""Rows that mix TRL's two message forms: a plain-string prompt with typed (block) answers.

Converted datasets often store the question as a string and the answers as conversations of blocks.
The images go first in the plain prompt's user turn, as TRL decides per message; the answers' form
says nothing about where the prompt's images are. A prompt written as blocks places its own images.
"""

from __future__ import annotations

import pytest
from PIL import Image

from lightning_vlm.data import normalize_row
from lightning_vlm.data.row_error import RowError

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


def test_a_plain_user_turn_takes_the_images_whatever_form_the_other_turns_take(image):
    # the `messages` form: a plain question, a typed answer
    row = {"messages": [{"role": "user", "content": "Colour?"}, *said("red")], "images": [image]}
    out = normalize_row(row, "sft")
    assert [m["content"] for m in out["messages"]] == [[IMG, text("Colour?")], [text("red")]]

    # a typed system turn before a plain question: the question is where the images go
    system = {"role": "system", "content": [text("Answer in one word.")]}
    row = {"prompt": [system, {"role": "user", "content": "Colour?"}], "images": [image]}
    out = normalize_row(row, "prompt")
    assert [m["content"] for m in out["prompt"]] == [[text("Answer in one word.")], [IMG, text("Colour?")]]


def test_images_placed_in_a_later_turn_stay_there(image):
    # a plain first question, the image block in a later typed turn: the row says where it goes
    later = {"role": "user", "content": [IMG, text("And now?")]}
    messages = [{"role": "user", "content": "Hi"}, *said("Hello"), later, *said("red")]
    out = normalize_row({"messages": messages, "images": [image]}, "sft")
    assert [m["content"] for m in out["messages"]] == [
        [text("Hi")],
        [text("Hello")],
        [IMG, text("And now?")],
        [text("red")],
    ]
    first = {"role": "user", "content": "Hi"}
    row = {
        "chosen": [first, later, *said("red")],
        "rejected": [first, later, *said("blue")],
        "images": [image],
    }
    out = normalize_row(row, "preference")
    assert [m["content"] for m in out["prompt"]] == [[text("Hi")], [IMG, text("And now?")]]
