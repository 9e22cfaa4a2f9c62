"""Sample completions a method records for logging (TRL's ``log_completions``): records, recorder, protocol.

A method that generates holds a :class:`CompletionRecorder` and, where it has completions and their
scores, records them *only when asked* (``recorder.wants(stage)``). The ``LogCompletions`` callback
asks (on global rank 0, on the steps it logs), reads the records and writes them out. Not asked, a
method builds nothing and keeps no reference to any text or image, so logging off costs a set lookup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightning_vlm.methods.common import message_text

if TYPE_CHECKING:
    from lightning_vlm.methods.rollout_buffer import RolloutBatch

# A table cell besides the image: a number, a text or a flag (None where there is no value).
Value = float | str | bool | None


@dataclass(frozen=True)
class CompletionSample:
    """One generated completion with its prompt, the prompt's first image and the method's columns.

    ``values`` are the method's own columns, in order: each reward function's value, the total
    ``reward`` and the ``advantage`` for online methods; ``reference`` and ``correct`` for SFT/DPO/KTO.
    ``image`` is the row's PIL image itself (a reference, not a copy), or None for a text-only row.
    """

    prompt: str
    completion: str
    image: Any | None
    values: dict[str, Value]


class CompletionRecorder:
    """Samples a method recorded on request, per stage (``"train"``, ``"val"``); one batch per request."""

    def __init__(self) -> None:
        self._wanted: set[str] = set()
        self._samples: dict[str, list[CompletionSample]] = {}

    def request(self, stage: str) -> None:
        """Ask for the next batch of ``stage`` samples (the callback does, on the steps it logs)."""
        self._wanted.add(stage)

    def wants(self, stage: str) -> bool:
        """Whether the method should build and record samples of ``stage`` now."""
        return stage in self._wanted

    def record(self, stage: str, samples: list[CompletionSample]) -> None:
        """Store ``samples`` and close the request: later batches (e.g. validation's) record nothing."""
        self._samples[stage] = samples
        self._wanted.discard(stage)

    def take(self, stage: str) -> list[CompletionSample]:
        """The recorded ``stage`` samples (empty if none), released here; the request is closed too."""
        self._wanted.discard(stage)
        return self._samples.pop(stage, [])

    def clear(self) -> None:
        """Drop every request and sample (the images they reference with them)."""
        self._wanted.clear()
        self._samples.clear()


@runtime_checkable
class RecordsCompletions(Protocol):
    """A method whose completions ``LogCompletions`` can log."""

    completion_recorder: CompletionRecorder


def prompt_text(prompt: str | Sequence[dict]) -> str:
    """A prompt for people: its text, or one ``role: text`` line per message of a multi-turn prompt."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return message_text(prompt[0])
    return "\n".join(f"{m['role']}: {message_text(m)}" for m in prompt)


def first_image(row: dict) -> Any | None:
    """The row's first image (rows reach the methods with an ``images`` list), or None."""
    images = row.get("images") or []
    return images[0] if images else None


def _number(value: float) -> float | None:
    # A reward function's None is NaN in the score matrix; None again here (NaN is not JSON), and so is an
    # infinite reward (json.dumps writes Infinity, which JSON readers refuse).
    return value if math.isfinite(value) else None


def rollout_samples(batch: RolloutBatch, reward_names: Sequence[str]) -> list[CompletionSample]:
    """One sample per completion of an online generation: each reward, the total and the advantage."""
    if batch.advantages is None:
        raise ValueError("rollout_samples needs the advantages: record after compute_advantages")
    rollouts = batch.rollouts
    per_function = batch.per_function.tolist()
    rewards, advantages = batch.rewards.tolist(), batch.advantages.tolist()
    samples = []
    for i, p in enumerate(rollouts.prompt_index):
        row = rollouts.rows[p]
        values: dict[str, Value] = {n: _number(v) for n, v in zip(reward_names, per_function[i], strict=True)}
        values.update(reward=_number(rewards[i]), advantage=_number(advantages[i]))
        text = rollouts.completion_texts[i]
        samples.append(CompletionSample(prompt_text(row["prompt"]), text, first_image(row), values))
    return samples


def answer_samples(
    rows: Sequence[dict], completions: Sequence[str], references: Sequence[str | None], hits: Sequence[float]
) -> list[CompletionSample]:
    """One sample per greedy validation answer (SFT, DPO, KTO): the reference answer and whether it
    matched. ``hits`` are those of the rows with a reference, in order (``greedy_answer_hits``); a row
    without one (a KTO row with an undesirable answer and no ``solution``) has ``correct`` None."""
    scorable = sum(r is not None for r in references)
    if len(hits) != scorable:
        raise ValueError(f"{len(hits)} hits for {scorable} references")
    scored = iter(hits)
    return [
        CompletionSample(
            prompt_text(row["prompt"]),
            text,
            first_image(row),
            {"reference": reference, "correct": None if reference is None else bool(next(scored))},
        )  # fmt: skip
        for row, text, reference in zip(rows, completions, references, strict=True)
    ]
