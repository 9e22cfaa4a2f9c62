"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2): keep only groups that can teach.

A group whose rewards all tie (every completion right, or every one wrong) has advantage 0 for every
sample, so it adds nothing to the policy gradient but still dilutes the step's normalisers. DAPO
drops such groups and samples more prompts until the batch is full. Here a step's data batch is the
*pool* of prompts for one step: its first ``⌈len(pool) / max_num_gen_batches⌉`` prompts (a round) are
generated, the groups a filter keeps are collected, and each further round (``max_num_gen_batches`` in
all) generates only as many of the next prompts as groups are still missing, until a round's worth are
kept (on every rank) or the rounds are used up. The step then trains on exactly one round's worth of groups,
kept ones first; if too few passed, the last filtered ones fill the gap, so the step keeps its shape for
micro-batching and DDP. With the built-in filter their advantages are 0: they change nothing but the
normalisers (token and sequence counts, and the batch std under ``scale_rewards: batch``). Under GDPO
``zero_std`` checks each weighted reward (``any_reward_std_filter``), as GDPO's advantages do. A custom
filter may drop groups that would teach; if they fill a step, they train like any other group. The
filter sees the rewards the loss trains on as far as they are known before any forward pass (Online
DPO's include ``missing_eos_penalty``); RLOO's KL penalty (``beta`` > 0) comes later, so there a tied
group, whose only signal is the KL, is dropped (DAPO has no KL term), and a filler group trains on it.
Whatever the filter, a group none of whose completions is left in the loss (every one truncated, under
``mask_truncated_completions``) is dropped too: it has no gradient, however its rewards differ (verl's DAPO
filters on every sample's reward, and keeps it).
Because the pool is the dataloader's batch and each round's sampling seed is derived from
(seed, global_step, rank, round), a resumed run regenerates exactly what the uninterrupted one drew.
Unused prompts of a pool are not revisited in that epoch: when the first round keeps enough groups,
the rest of the pool goes ungenerated, so an epoch may train on as little as 1/``max_num_gen_batches``
of the data (verl draws its next generation batch only when one is needed and skips none; it discards
surplus kept groups instead).

The filter is any callable ``keep(rewards [G], per_function [G, F]) -> bool`` (``GroupFilter``);
``"zero_std"`` (DAPO's: at least two valid rewards that differ) is built in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_vlm.generation.base import Rollouts


@runtime_checkable
class GroupFilter(Protocol):
    """Decides whether one prompt's group of completions is trained on."""

    def __call__(self, rewards: torch.Tensor, per_function: torch.Tensor) -> bool:
        """``rewards``: the G weighted rewards (NaN: missing); ``per_function``: [G, F] per reward function."""
        ...


def zero_std_filter(rewards: torch.Tensor, per_function: torch.Tensor) -> bool:
    """DAPO's filter: keep a group whose valid rewards are not all equal (so its std is > 0)."""
    valid = rewards[~rewards.isnan()]
    return valid.numel() >= 2 and bool((valid != valid[0]).any())


def any_reward_std_filter(rewards: torch.Tensor, per_function: torch.Tensor, weights: torch.Tensor) -> bool:
    """``zero_std`` under GDPO (``multi_objective_aggregation: normalize_then_sum``): keep a group in which
    some reward with a non-zero weight varies. GDPO normalises each reward in its group before summing,
    so such a group teaches even when the weighted totals tie (1·[1, 0] + 0.5·[0, 2] is [1, 1])."""
    return any(
        zero_std_filter(per_function[:, k], per_function) for k in range(len(weights)) if weights[k] != 0
    )


FILTERS: dict[str, GroupFilter] = {"zero_std": zero_std_filter}


@dataclass(frozen=True)
class DynamicSampling:
    """Settings: ``enabled``; ``filter`` ("zero_std" or a ``GroupFilter``); ``max_num_gen_batches``,
    the number of rounds a step's prompt pool is split into (verl's name), at least 2: with one round
    nothing is left to resample, and the filtered groups would fill the step back up."""

    enabled: bool = False
    filter: str | GroupFilter = "zero_std"
    max_num_gen_batches: int = 3

    @classmethod
    def of(cls, value: DynamicSampling | dict | None) -> DynamicSampling:
        """From a config mapping (or None: off), checked: the error names the bad key. A mapping turns
        dynamic sampling on unless it says ``enabled: false``: ``{max_num_gen_batches: 5}`` means it."""
        if value is None or isinstance(value, DynamicSampling):
            return value or cls()
        if not isinstance(value, Mapping):
            raise ValueError(
                f"method.dynamic_sampling must be a mapping such as {{enabled: true}} (or null: off), "
                f"got {value!r}"
            )
        unknown = set(value) - {"enabled", "filter", "max_num_gen_batches"}
        if unknown:
            raise ValueError(
                f"unknown method.dynamic_sampling keys {sorted(unknown)}; "
                "expected enabled, filter, max_num_gen_batches"
            )
        settings = cls(**{"enabled": True, **value})
        if not isinstance(settings.enabled, bool):
            raise ValueError(
                f"method.dynamic_sampling.enabled must be true or false, got {settings.enabled!r}"
            )
        rounds = settings.max_num_gen_batches
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 2:
            raise ValueError(
                f"method.dynamic_sampling.max_num_gen_batches must be an integer >= 2 (generation rounds "
                f"per step), got {rounds!r}: a single round leaves nothing to resample, so the filtered "
                "groups would fill the step back and it would train as without dynamic sampling"
            )
        settings.group_filter  # noqa: B018 (fail now on an unknown filter name)
        return settings

    @property
    def group_filter(self) -> GroupFilter:
        if isinstance(self.filter, str):
            if self.filter not in FILTERS:
                raise ValueError(
                    f"method.dynamic_sampling.filter {self.filter!r} is unknown; use one of "
                    f"{sorted(FILTERS)} or a callable keep(rewards, per_function) -> bool (_target_ + _partial_)"
                )
            return FILTERS[self.filter]
        if not callable(self.filter):
            raise TypeError(
                f"method.dynamic_sampling.filter must be a name or a callable, got {self.filter!r}"
            )
        return self.filter

    def describe(self) -> dict[str, Any]:
        """Plain values for hparams (a callable filter by its qualified name): checkpoints stay loadable
        with ``weights_only=True``."""
        func = getattr(self.filter, "func", self.filter)  # a functools.partial: the function it wraps
        name = self.filter if isinstance(self.filter, str) else getattr(func, "__qualname__", repr(func))
        return {"enabled": self.enabled, "filter": name, "max_num_gen_batches": self.max_num_gen_batches}

    def round_size(self, pool: int) -> int:
        """Prompts per generation round (= groups trained on per step) for a pool of ``pool`` prompts:
        ⌈pool / max_num_gen_batches⌉, so an epoch's last, shorter batch still runs (in smaller rounds)."""
        rounds = self.max_num_gen_batches if self.enabled else 1
        return -(-pool // rounds)


def select_groups(rollouts: Rollouts, groups: Sequence[int]) -> Rollouts:
    """The rollouts of prompt rows ``groups`` (indices into ``rollouts.rows``), in that order."""
    g = rollouts.num_generations
    return select_completions(rollouts, groups, [i * g + j for i in groups for j in range(g)], g)


def select_completions(
    rollouts: Rollouts, groups: Sequence[int], index: Sequence[int], num_generations: int
) -> Rollouts:
    """Completions ``index`` of ``rollouts``, ``num_generations`` per row of ``groups``, in that order."""
    logprobs = None if rollouts.logprobs is None else [rollouts.logprobs[i] for i in index]
    return Rollouts(
        rows=[rollouts.rows[i] for i in groups],
        completion_ids=[rollouts.completion_ids[i] for i in index],
        completion_texts=[rollouts.completion_texts[i] for i in index],
        truncated=[rollouts.truncated[i] for i in index],
        num_generations=num_generations,
        logprobs=logprobs,
        extras=dict(rollouts.extras),
    )


def concat_rollouts(parts: Sequence[Rollouts]) -> Rollouts:
    """Rollouts of several rounds as one (the first round's ``extras``: one generator made them all)."""
    has_logprobs = all(p.logprobs is not None for p in parts)
    return Rollouts(
        rows=[r for p in parts for r in p.rows],
        completion_ids=[c for p in parts for c in p.completion_ids],
        completion_texts=[t for p in parts for t in p.completion_texts],
        truncated=[t for p in parts for t in p.truncated],
        num_generations=parts[0].num_generations,
        logprobs=[lp for p in parts for lp in p.logprobs] if has_logprobs else None,  # type: ignore[union-attr]
        extras=dict(parts[0].extras),
    )


@dataclass
class Collected:
    """What the rounds of one step gathered: kept and filtered groups (rollouts with their rewards)."""

    kept: list[tuple[Rollouts, torch.Tensor]] = field(default_factory=list)
    dropped: list[tuple[Rollouts, torch.Tensor]] = field(default_factory=list)
    rounds: int = 0
    generated: int = 0  # completions generated
    filtered: int = 0  # groups the filter dropped while this rank still needed groups

    @property
    def num_kept(self) -> int:
        return sum(len(r.rows) for r, _ in self.kept)


def collect(
    pool: list[dict],
    settings: DynamicSampling,
    generate: Callable[[list[dict], int], Rollouts],
    score: Callable[[Rollouts], torch.Tensor],
    total: Callable[[Rollouts, torch.Tensor], torch.Tensor],
    everyone_has: Callable[[bool], bool],
    in_loss: Callable[[Rollouts], Sequence[bool]] | None = None,
) -> tuple[Rollouts, torch.Tensor, dict[str, float]]:
    """Generate ``pool`` round by round until a round's worth of groups passes the filter.

    ``generate(rows, round)`` samples (seeded by the round), ``score`` gives [N, F] rewards,
    ``total(rollouts, per_function)`` the [N] rewards the method trains on (their weighted sum, less
    any penalty); ``everyone_has(done)`` is True when every rank is done (a collective, so all ranks
    run the same rounds: FSDP's forwards must match); ``in_loss(rollouts)`` says which completions the loss
    keeps (None: all). Returns the step's rollouts, their [N, F]
    rewards, and this rank's counts (rounds, generated, kept, filtered, filled groups).
    """
    size = settings.round_size(len(pool))
    keep = settings.group_filter
    got = Collected()
    start, wanted = 0, size
    for _ in range(settings.max_num_gen_batches if settings.enabled else 1):
        # After the first round, only as many prompts as groups are still missing: verl draws a whole
        # round each time and drops the surplus, most of a round's samples. A pool used up (an epoch's
        # short last batch) starts over with new seeds, so every rank still runs every round.
        rows = [pool[(start + i) % len(pool)] for i in range(wanted)]
        start += wanted
        rollouts = generate(rows, got.rounds)
        per_function = score(rollouts)
        got.rounds += 1
        got.generated += len(rollouts)
        if not settings.enabled:
            return rollouts, per_function, {}
        g = rollouts.num_generations
        rewards = total(rollouts, per_function).view(-1, g)
        kept = [True] * len(rollouts) if in_loss is None else list(in_loss(rollouts))
        decisions = [
            any(kept[i * g : (i + 1) * g]) and bool(keep(rewards[i], per_function[i * g : (i + 1) * g]))
            for i in range(len(rewards))
        ]
        if got.num_kept < size:  # a full rank's draw only keeps the rounds aligned: not a filtering
            got.filtered += decisions.count(False)
        for passed, target in ((True, got.kept), (False, got.dropped)):
            groups = [i for i, d in enumerate(decisions) if d == passed]
            if groups:
                index = torch.tensor([i * g + j for i in groups for j in range(g)])
                target.append((select_groups(rollouts, groups), per_function[index]))
        if everyone_has(got.num_kept >= size):
            break
        wanted = max(size - got.num_kept, 1)  # ranks already full draw one prompt: rounds stay aligned
    parts = got.kept + got.dropped[::-1]  # kept first, then the latest filtered ones
    rollouts = select_groups(concat_rollouts([r for r, _ in parts]), range(size))
    per_function = torch.cat([p for _, p in parts])[: size * rollouts.num_generations]
    counts = {
        "rounds": float(got.rounds),
        "generated": float(got.generated),
        "groups_kept": float(min(got.num_kept, size)),
        "groups_filtered": float(got.filtered),
        "groups_filled": float(max(size - got.num_kept, 0)),
    }
    return rollouts, per_function, counts
