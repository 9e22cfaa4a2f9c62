"""Built-in reward functions: plain callables ``fn(completions, **columns) -> list[float | None]``.

Every reward function receives the completions and, as keyword arguments, ``prompts`` and every
dataset column (e.g. ``solution``), each a list aligned with ``completions``; it returns one float
per completion, or ``None`` where it does not apply (TRL's convention: a ``None`` is left out of the
group statistics). Unknown columns are accepted and ignored (``**kwargs``). Functions that take
settings are configured with ``functools.partial`` or, from Hydra, ``_partial_: true``::

    - _target_: lightning_vlm.rewards.length_reward
      _partial_: true
      max_length: 512
      cache_length: 128

The online methods pass TRL's conversational form (one assistant message per completion, whose
``content`` is a string or typed blocks) and ``trainer_state``; plain strings are accepted too.
:func:`completion_text` turns either into text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_vlm.rewards.accuracy import answers_match
from lightning_vlm.rewards.answers import count_reward, missing_solution, numeric_reward
from lightning_vlm.rewards.boxes import giou_reward, iou_reward
from lightning_vlm.rewards.choices import multiple_choice_reward
from lightning_vlm.rewards.ocr import ocr_reward

Completion = str | Sequence[Mapping[str, Any]]

# Whole-completion shape of the reasoning format (R1-V / EasyR1): optional whitespace around and
# between the two blocks, nothing else. Tags are case-sensitive on purpose: the format rewarded is
# the exact one the prompt asks for. Block contents are checked separately (see _tags_nested).
_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.S)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.S)
_ANY_TAG = re.compile(r"</?(?:think|answer)>")
_ANSWER_TAG = re.compile(r"</?answer>")

LENGTH_UNITS = ("tokens", "chars", "words")


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or typed blocks whose text blocks are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Typed blocks: image blocks (stored datasets give them "text": None) carry no text.
    parts = [b.get("text") for b in content if isinstance(b, Mapping) and b.get("type") == "text"]
    return "\n".join(p for p in parts if p)


def completion_text(completion: Completion) -> str:
    """A completion as text: the string itself, or the joined contents of its messages."""
    if isinstance(completion, str):
        return completion
    return "\n".join(content_text(m.get("content")) for m in completion)


def _missing(value: Any) -> bool:
    # Datasets with missing cells give None, or NaN (any float type: numpy's float32 is no float) or
    # pandas' NA / NaT when they went through pandas.
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    if isinstance(value, list | tuple):
        # An empty list holds no reference: no accepted answer, no box.
        return not value
    if isinstance(value, (str, bytes)):
        return not value.strip()
    try:
        return math.isnan(value)
    except (TypeError, ValueError):  # dicts, arrays, ...: a value
        return False


def accuracy_reward(
    completions: Sequence[Completion], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer matches ``solution`` (see ``answers_match``), else 0.0; None without one."""
    if solution is None:
        # A missing column is a configuration mistake (wrong dataset or column name), not a row
        # without a reference: every score would silently be None.
        raise missing_solution("accuracy_reward", kwargs)
    rewards: list[float | None] = []
    for completion, reference in zip(completions, solution, strict=True):
        if _missing(reference):
            rewards.append(None)
        else:  # a list of strings: accepted answers, any one matches (answers_match)
            rewards.append(1.0 if answers_match(completion_text(completion), reference) else 0.0)
    return rewards


def _tags_nested(text: str) -> bool:
    return _ANY_TAG.search(text) is not None


def think_format_reward(
    completions: Sequence[Completion], generation_prompt: str = "", **kwargs: Any
) -> list[float]:
    """1.0 if the completion is exactly ``<think>...</think><answer>...</answer>`` (whitespace-tolerant), else 0.0.

    The think block may be empty; the answer block must hold some text. Neither may contain a
    further think/answer tag, so a second answer block fails. Unlike TRL's ``think_format_reward``
    (which checks only the think block) this also requires the answer block that
    ``accuracy_reward`` reads. When the chat template's ``generation_prompt`` ends with ``<think>``
    (thinking models prefill it), the completion starts inside the think block and is read after it;
    TRL's scores every such completion 0.
    """
    prefilled = generation_prompt.rstrip().endswith("<think>")
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        match = _THINK_ANSWER.fullmatch(f"<think>{text}" if prefilled else text)
        ok = (
            match is not None
            and not _tags_nested(match.group(1))
            and not _tags_nested(match.group(2))
            and bool(match.group(2).strip())
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def answer_format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float]:
    """1.0 if the completion holds exactly one non-empty ``<answer>...</answer>`` block, else 0.0.

    For prompts that ask for a tagged answer without reasoning; text around the block is allowed.
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        blocks = _ANSWER_BLOCK.findall(text)
        ok = (
            len(blocks) == 1
            and bool(blocks[0].strip())
            # A stray or unclosed answer tag, inside or outside the block, is a malformed answer.
            and _ANSWER_TAG.search(_ANSWER_BLOCK.sub("", text)) is None
            and _ANSWER_TAG.search(blocks[0]) is None
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def _length(completion: Completion, ids: Sequence[int] | None, unit: str) -> int:
    if unit == "tokens":
        return len(ids) if ids is not None else 0
    text = completion_text(completion)
    return len(text) if unit == "chars" else len(text.split())


def length_reward(
    completions: Sequence[Completion],
    *,
    max_length: int,
    cache_length: int = 0,
    unit: str = "tokens",
    completion_ids: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to ``max_length - cache_length``, then linearly down to -1 at ``max_length``.

    With ``L`` the completion's length, ``L_max = max_length`` and ``L_cache = cache_length``::

        0                                    if L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache      if L_max - L_cache < L <= L_max
        -1                                   if L > L_max

    the same as TRL's ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``.
    ``cache_length=0`` is a hard cut: -1 only beyond ``max_length``. ``unit`` is ``"tokens"``
    (counted from the ``completion_ids`` column the trainer passes, as in TRL), ``"chars"`` or
    ``"words"`` (counted from the text, for callers without token ids).
    """
    if unit not in LENGTH_UNITS:
        raise ValueError(f"length_reward: unknown unit {unit!r}; expected one of {LENGTH_UNITS}")
    if max_length <= 0 or not 0 <= cache_length <= max_length:
        raise ValueError(
            f"length_reward: need max_length > 0 and 0 <= cache_length <= max_length; "
            f"got max_length={max_length}, cache_length={cache_length}"
        )
    if unit == "tokens" and completion_ids is None:
        # Falling back to characters would change the meaning of max_length about fourfold.
        raise ValueError(
            "length_reward with unit='tokens' needs the `completion_ids` column; "
            "pass unit='chars' or unit='words' to measure the text instead"
        )
    ids_per_row: Sequence[Sequence[int] | None] = (
        completion_ids if completion_ids is not None else [None] * len(completions)
    )
    free = max_length - cache_length
    rewards = []
    for completion, ids in zip(completions, ids_per_row, strict=True):
        length = _length(completion, ids, unit)
        if length <= free:
            rewards.append(0.0)
        elif length <= max_length:
            rewards.append((free - length) / cache_length)
        else:
            rewards.append(-1.0)
    return rewards


BUILTIN_REWARDS = {
    "accuracy_reward": accuracy_reward,
    "think_format_reward": think_format_reward,
    "answer_format_reward": answer_format_reward,
    "length_reward": length_reward,
    "iou_reward": iou_reward,
    "giou_reward": giou_reward,
    "count_reward": count_reward,
    "numeric_reward": numeric_reward,
    "multiple_choice_reward": multiple_choice_reward,
    "ocr_reward": ocr_reward,
}
