"""One small interface for every sampler (HF generate, vLLM colocated, vLLM server)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingOptions:
    """How completions are sampled, except their length; names and defaults follow HF/vLLM (``top_k`` 0
    or None = off). The online methods' ``method.sampling`` config node is built from these fields
    (``lightning_vlm.config``), so the defaults are written here only."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    do_sample: bool = True


@dataclass
class SamplingSettings(SamplingOptions):
    """``SamplingOptions`` plus the number of tokens to generate (online methods: ``max_completion_length``)."""

    max_new_tokens: int = 16

    @classmethod
    def of(cls, options: SamplingOptions | Mapping[str, Any] | None, max_new_tokens: int) -> SamplingSettings:
        """``options`` (a Hydra node arrives as a mapping) generating ``max_new_tokens`` tokens. The length
        is only ever the argument (online methods: ``max_completion_length``), never a second setting."""
        if isinstance(options, SamplingSettings) or (
            isinstance(options, Mapping) and "max_new_tokens" in options
        ):
            raise ValueError(
                "the completion length is max_completion_length: leave max_new_tokens out of sampling"
            )
        if isinstance(options, SamplingOptions):
            options = {f.name: getattr(options, f.name) for f in fields(SamplingOptions)}
        return cls(max_new_tokens=max_new_tokens, **dict(options or {}))

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
    """Everything the online loop (``methods.online``) and the vLLM callback use of a sampler.

    ``is_policy``: whether it samples from the training weights themselves (HF generate on the policy);
    otherwise the loop applies the importance-sampling correction with ``Rollouts.logprobs``.
    """

    is_policy: bool

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """Completions for ``rows`` (each with ``prompt`` and ``images``), G consecutive per row."""
        ...

    def set_seed(self, seed: int | None) -> None:
        """Seed the following ``generate`` calls (the same seed redraws the same completions); None: unseeded."""
        ...

    def sync_weights(self, chunks: Iterable[dict[str, Any]] | None = None) -> float:
        """Bring the sampler's weights to the policy's (or its FSDP ``chunks``); seconds taken."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory for the backward pass until the next ``wake_up``/``generate``."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep``."""
        ...

    def close(self) -> None:
        """Release the engine (and its memory, processes, temporary files)."""
        ...


class OwnWeightsGenerator:
    """The engine hooks of a ``Generator`` that samples from the module it was given (HF generate, test
    fakes): there is no copy of the weights to sync, no engine memory to free and nothing to close.
    ``set_seed`` stores the seed in ``self.seed`` for ``generate`` to use."""

    is_policy = True
    seed: int | None = None

    def set_seed(self, seed: int | None) -> None:
        """Seed the following ``generate`` calls; None: unseeded."""
        self.seed = seed

    def sync_weights(self, chunks: Iterable[dict[str, Any]] | None = None) -> float:
        """Nothing to push: the sampler reads the policy's own parameters."""
        return 0.0

    def sleep(self) -> None:
        """No-op: nothing of its own on the accelerator."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """No-op: no engine."""


@contextlib.contextmanager
def seeded(generator: Generator, seed: int | None, device: torch.device) -> Iterator[None]:
    """Run with ``generator`` seeded to ``seed`` (vLLM: per-request seeds; HF: torch's RNG, in a fork of it
    so the caller's state is untouched), then restored; nothing changes for ``None``. Rewards are scored
    after this block: a reward function that draws random numbers is not replayed by a resume."""
    if seed is None:
        yield
        return
    with torch_seeded(seed, device):
        generator.set_seed(seed)
        try:
            yield
        finally:
            generator.set_seed(None)


@contextlib.contextmanager
def torch_seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with torch's RNG (CPU and ``device``'s CUDA generator) seeded to ``seed``, then restored."""
    import torch  # here: composing a config imports this module, and needs no torch

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # seeds the CUDA generators too
        yield


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    """``ids`` up to and including the first end-of-sequence token; ``truncated`` when there is none.

    Batch generators pad only *after* a row's eos, so an unfinished row is kept whole (a sampled
    pad-token id inside it is a real token).
    """
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1], False
    return list(ids), True
