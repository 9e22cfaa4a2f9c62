"""One small interface for every sampler (HF generate, vLLM colocated, vLLM server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class SamplingSettings:
    """How completions are sampled; names and defaults follow HF/vLLM (``top_k`` 0 or None = off)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    do_sample: bool = True

    @property
    def greedy(self) -> bool:
        """Greedy decoding: sampling switched off, or temperature 0 (as vLLM reads it)."""
        return not self.do_sample or self.temperature == 0


@dataclass
class Rollouts:
    """Completions of a batch of prompt rows; the ``num_generations`` of one prompt are consecutive.

    ``completion_ids[i]`` ends with the end-of-turn token unless ``truncated[i]`` (no end-of-turn
    within ``max_new_tokens``). ``logprobs`` are the sampler's per-token log-probs (None if it has none).
    """

    rows: list[dict]
    completion_ids: list[list[int]]
    completion_texts: list[str]
    truncated: list[bool]
    num_generations: int
    logprobs: list[list[float]] | None = None
    extras: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def prompt_index(self) -> list[int]:
        """Index into ``rows`` of each completion's prompt."""
        return [i // self.num_generations for i in range(len(self.completion_ids))]


@runtime_checkable
class Generator(Protocol):
    """Anything that samples ``num_generations`` completions per prompt row."""

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """Completions for ``rows`` (each with ``prompt`` and ``images``), G consecutive per row."""
        ...


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    """``ids`` up to and including the first end-of-sequence token; ``truncated`` when there is none.

    Batch generators pad only *after* a row's eos, so an unfinished row is kept whole (a sampled
    pad-token id inside it is a real token).
    """
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1], False
    return list(ids), True
