"""Score completions with several reward functions and combine them with weights (TRL's semantics).

Each function returns one float or ``None`` per completion; ``None`` becomes NaN in the score
matrix and is skipped by the weighted sum, and a sample where every function returned ``None``
totals NaN (the method leaves it out of group statistics and gives it advantage 0). Every failure
of a function (raising, wrong length, a non-number, a value or weighted total beyond float32, the
dtype scores are kept in) is re-raised as :class:`RewardFunctionError` naming the function, so a
long run with five rewards says which one broke.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vlm.rewards.builtin import BUILTIN_REWARDS

RewardFunction = Callable[..., Sequence[Any]]
# Scores are float32 tensors: a larger Python float would become inf there, silently.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the function."""


def _unwrap(fn: Any) -> tuple[Any, dict[str, Any]]:
    # Nested partials (a partial of a partial) merge their keywords, outer ones winning.
    keywords: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return fn, keywords


def reward_name(fn: Any) -> str:
    """A short name for logs: the function's ``__name__`` (a partial's underlying function's), else its class name."""
    base, _ = _unwrap(fn)
    name = getattr(base, "__name__", None)
    return name if isinstance(name, str) else type(base).__name__


def describe(fn: Any) -> str:
    """A precise description for error messages: module-qualified name plus a partial's settings."""
    base, keywords = _unwrap(fn)
    qualname = getattr(base, "__qualname__", None)
    if qualname is None:
        # A callable object (e.g. a RewardModel): its repr says which model or settings it holds.
        text = repr(base)
    else:
        module = getattr(base, "__module__", None)
        text = f"{module}.{qualname}" if module else qualname
    if keywords:
        text += " with " + ", ".join(f"{k}={v!r}" for k, v in keywords.items())
    return text


def resolve_reward_function(spec: Any) -> RewardFunction:
    """A callable as is; a string as a built-in name (``"accuracy_reward"``) or a dotted import path."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a reward function must be callable or a name/dotted path; got {type(spec).__name__}"
        )
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, _, attr = spec.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import reward function {spec!r}: {err}") from err
    if not callable(fn):
        # TRL treats other strings as reward-model ids; here that is explicit, so say how.
        raise ValueError(
            f"{spec!r} is neither a built-in reward ({sorted(BUILTIN_REWARDS)}) nor an importable callable; "
            "for a reward model use lightning_vlm.rewards.RewardModel(model_name_or_path)"
        )
    return fn


def _dedupe(names: list[str]) -> list[str]:
    # Two length_reward partials with different settings must not share a log key (or a weight by
    # name): a repeat takes the first suffix that no function has or had (f, f, f_2 -> f, f_3, f_2).
    reserved, out = set(names), []
    for name in names:
        unique, k = name, 1
        while unique in out or (unique != name and unique in reserved):
            k += 1
            unique = f"{name}_{k}"
        out.append(unique)
    return out


def _as_reward(value: Any) -> float:
    # numpy and torch scalars: take their Python value; everything else must be a real number.
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise TypeError(f"{type(value).__name__} {value!r} is not a number")
    return float(value)


@dataclass(frozen=True)
class TrainerState:
    """What TRL's reward functions read of ``trainer_state`` (its ``TrainerState``'s names): the optimizer
    steps done, the epoch with its fraction done, and the run's length in optimizer steps (-1: unbounded),
    e.g. for a reward schedule ``global_step / max_steps``."""

    global_step: int
    epoch: float
    max_steps: int


class RewardScorer:
    """Calls reward functions on completions and columns; gives an [N, F] score matrix and weighted totals."""

    def __init__(
        self,
        functions: Sequence[Any] | Mapping[str, Any],
        weights: Sequence[float] | Mapping[str, float] | None = None,
    ) -> None:
        if isinstance(functions, Mapping):
            names = [str(k) for k in functions]
            self.functions = [resolve_reward_function(f) for f in functions.values()]
        else:
            self.functions = [resolve_reward_function(f) for f in functions]
            names = _dedupe([reward_name(f) for f in self.functions])
        if not self.functions:
            raise ValueError("RewardScorer needs at least one reward function")
        self.names: list[str] = names
        self.weights = self._weights(weights)

    def _weights(self, weights: Sequence[float] | Mapping[str, float] | None) -> torch.Tensor:
        if weights is None:
            values = [1.0] * len(self.functions)
        elif isinstance(weights, Mapping):
            unknown = sorted(set(map(str, weights)) - set(self.names))
            if unknown:
                raise ValueError(
                    f"reward weights for unknown functions {unknown}; the functions are {self.names}"
                )
            # Functions without a weight keep 1.0, TRL's default.
            values = [float(weights.get(n, 1.0)) for n in self.names]
        else:
            values = [float(w) for w in weights]
            if len(values) != len(self.functions):
                raise ValueError(
                    f"reward_weights: got {len(values)} reward weights for {len(self.functions)} reward "
                    f"functions {self.names}"
                )
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"reward weights must be finite; got {values}")
        return torch.tensor(values, dtype=torch.float32)

    def __call__(
        self, completions: Sequence[Any], columns: Mapping[str, Any] | None = None
    ) -> tuple[torch.Tensor, list[str]]:
        """Score every completion with every function: a float [N, F] tensor (NaN for None) and the names."""
        columns = dict(columns or {})
        n = len(completions)
        if "completions" in columns:
            raise ValueError("`completions` is passed separately; it cannot also be a column")
        for key, value in columns.items():
            # Lists are per-sample columns and must line up; other values (e.g. a trainer state)
            # pass through as they are.
            if isinstance(value, list | tuple) and len(value) != n:
                raise ValueError(f"column {key!r} has {len(value)} entries for {n} completions")
        scores = torch.full((n, len(self.functions)), math.nan, dtype=torch.float32)
        for j, fn in enumerate(self.functions):
            scores[:, j] = torch.tensor(
                self._run(fn, self.names[j], completions, columns), dtype=torch.float32
            )
        return scores, list(self.names)

    def _run(self, fn: RewardFunction, name: str, completions: Sequence[Any], columns: dict) -> list[float]:
        where = f"reward function {name!r} ({describe(fn)})"
        try:
            # All keywords, as TRL calls them: `def f(prompts, completions, **kw)` and
            # `def f(completions, solution, **kw)` both work.
            out = fn(completions=completions, **columns)
        except Exception as err:
            raise RewardFunctionError(f"{where} raised {type(err).__name__}: {err}") from err
        if isinstance(out, torch.Tensor) or hasattr(out, "tolist"):
            out = out.tolist()
        if isinstance(out, str | bytes | Mapping) or not isinstance(out, Sequence):
            raise RewardFunctionError(
                f"{where} returned {type(out).__name__}; expected a list with one float per completion"
            )
        if len(out) != len(completions):
            raise RewardFunctionError(
                f"{where} returned {len(out)} rewards for {len(completions)} completions"
            )
        values = []
        for i, value in enumerate(out):
            if value is None:
                values.append(math.nan)
                continue
            try:
                reward = _as_reward(value)
            except TypeError as err:
                raise RewardFunctionError(f"{where} returned a non-number for sample {i}: {err}") from err
            except OverflowError as err:
                # An int (or Fraction) past a float's range: 10**400. Not written out in the message: past
                # 4300 digits, int-to-text raises ValueError.
                raise RewardFunctionError(
                    f"{where} returned {type(value).__name__} too large for a float for sample {i}, beyond "
                    f"float32's range (±{FLOAT32_MAX:.3g}) that rewards are kept in; scale it down"
                ) from err
            # NaN means "no reward" like None; infinities would poison the group statistics.
            if math.isinf(reward):
                raise RewardFunctionError(f"{where} returned {reward} for sample {i}; rewards must be finite")
            if abs(reward) > FLOAT32_MAX:
                raise RewardFunctionError(
                    f"{where} returned {reward:g} for sample {i}, beyond float32's range (±{FLOAT32_MAX:.3g}) "
                    "that rewards are kept in; scale it down"
                )
            values.append(reward)
        return values

    def total(self, per_function: torch.Tensor) -> torch.Tensor:
        """Weighted sum over functions, skipping NaN; NaN where every function gave None.

        Summed in float64: rewards near float32's limit (1e38) add up without overflowing; a total
        that does not fit ``per_function``'s dtype raises :class:`RewardFunctionError` naming the
        functions and weights rather than becoming inf.
        """
        weights = self.weights.to(per_function.device, torch.float64)
        total = torch.nansum(per_function.double() * weights, dim=1)
        too_big = total.abs() > torch.finfo(per_function.dtype).max
        if too_big.any():
            i = int(too_big.nonzero()[0])
            terms = zip(self.names, self.weights.tolist(), per_function[i].tolist(), strict=True)
            parts = ", ".join(f"{name}: {w:g} × {r:g}" for name, w, r in terms)
            raise RewardFunctionError(
                f"the weighted reward of sample {i} ({float(total[i]):g}: {parts}) is beyond "
                f"{per_function.dtype}'s range; scale these reward functions or method.reward_weights down"
            )
        total = total.to(per_function.dtype)
        return total.masked_fill(per_function.isnan().all(dim=1), math.nan)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights.tolist(), strict=True))
        return f"RewardScorer({parts})"
