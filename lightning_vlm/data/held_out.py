"""What makes two rows "the same prompt", for ``data.val_fraction``: it holds out whole prompts.

Preference data often holds several pairs per prompt (RLAIF-V, all pairs of ranked answers), SFT data
several answers per question, prompt data repeated prompts. Held out row by row, validation would
score prompts the model trained on, and flatter it with no sign why. A prompt is its messages before
the first trained answer together with its images: the same question about another image is another
example.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from PIL import Image

from lightning_vlm.data.rows import COMPLETION_MESSAGES


def _image_key(ref: Any) -> str:
    """An image reference (a path, encoded bytes or a PIL image) as text: bytes and pixels by their digest."""
    if isinstance(ref, bytes):
        return "sha1:" + hashlib.sha1(ref).hexdigest()
    if isinstance(ref, Image.Image):  # the synthetic task's in-memory images
        return f"pixels:{ref.mode}:{ref.size}:" + hashlib.sha1(ref.tobytes()).hexdigest()
    return "path:" + os.path.normpath(str(ref))


def _prompt_messages(row: Mapping, shape: str) -> list[dict]:
    if shape != "sft":
        return row["prompt"]
    messages = row["messages"]
    if COMPLETION_MESSAGES in row:  # prompt-completion form: the completion is what is trained on
        return messages[: len(messages) - row[COMPLETION_MESSAGES]]
    first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first_answer]


def prompt_key(row: Mapping, shape: str) -> str:
    """A digest of normalised ``row``'s prompt and images: equal for rows that ask the same thing."""
    key = [_prompt_messages(row, shape), [_image_key(ref) for ref in row["images"]]]
    # default=str: a pass-through value JSON cannot write (a date in a message's extra field) is text here
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
