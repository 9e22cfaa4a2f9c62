"""A reward for one task's rows of a data set that mixes tasks.

Mixed data (counting, multiple choice and OCR rows in one run) needs a different reward per row; verl
routes its scores by a ``data_source`` column for this. ``TaskReward`` wraps any reward function so it
scores only the rows whose task column names its task and returns ``None`` elsewhere, which the scorer
leaves out of the group statistics and of the reward's own metric (``rewards/<name>`` is then the mean
over that task's rows). One wrapper per task keeps each reward's settings and metric apart::

    reward_funcs:
      - {_target_: lightning_vlm.rewards.TaskReward, reward: count_reward, task: count_cells}
      - _target_: lightning_vlm.rewards.TaskReward
        task: size
        reward: {_target_: lightning_vlm.rewards.numeric_reward, _partial_: true, abs_tol: 8}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from lightning_vlm.rewards.scoring import describe, resolve_reward_function, reward_name

log = logging.getLogger(__name__)
# Completions seen with no row of the task before the warning that the task name may be wrong (a misspelt
# task is otherwise silent). Completions, not prompts: a group repeats its prompt's task, so 4096 are 512
# prompts at 8 samples each, which a task of 1 % of the rows misses by chance with probability 0.6 %.
WARN_AFTER = 4096


class TaskReward:
    """``reward`` on the rows whose ``column`` is ``task`` (or one of several tasks); ``None`` on the others."""

    def __init__(self, reward: Any, task: str | int | Sequence[str | int], column: str = "task") -> None:
        self.reward = resolve_reward_function(reward)
        # Tasks match as text: YAML reads `task: 1` as an int, and a column may hold 1 or "1".
        many = isinstance(task, Sequence) and not isinstance(task, str)
        self.tasks = frozenset(str(t) for t in (task if many else [task]))
        if not self.tasks:
            raise ValueError("TaskReward needs at least one task")
        self.column = column
        # The wrapped reward's name, so logs read rewards/count_reward, not rewards/TaskReward.
        self.__name__ = reward_name(self.reward)
        self.seen, self.matched = 0, 0  # completions watched (until WARN_AFTER), and those of the task
        self.values: set[str] = set()  # the column's values met so far, as reprs for the warning

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        if self.column not in columns:
            raise ValueError(
                f"TaskReward({sorted(self.tasks)}) routes by the column {self.column!r}, which the data does "
                f"not have; the columns given were {sorted(columns)}"
            )
        n = len(completions)
        rows = [
            i for i, task in enumerate(columns[self.column]) if task is not None and str(task) in self.tasks
        ]
        self._watch(n, len(rows), columns[self.column])
        rewards: list[float | None] = [None] * n
        if not rows:
            return rewards
        # Per-row columns (lists as long as the completions) are cut to the routed rows; the rest pass as is.
        picked = {
            key: [value[i] for i in rows] if isinstance(value, list | tuple) and len(value) == n else value
            for key, value in columns.items()
        }
        out = list(self.reward(completions=[completions[i] for i in rows], **picked))
        if len(out) != len(rows):
            raise ValueError(f"{describe(self.reward)} returned {len(out)} rewards for {len(rows)} rows")
        for i, value in zip(rows, out, strict=True):
            rewards[i] = value
        return rewards

    def _watch(self, n: int, matched: int, values: Sequence[Any]) -> None:
        """Warn once when many completions passed and none was of the task (a misspelt task name)."""
        if self.matched or self.seen >= WARN_AFTER:
            return  # the task was met, or the warning's moment has passed: no more counting or reprs
        self.seen, self.matched = self.seen + n, matched
        if len(self.values) < 20:
            self.values.update(repr(v) for v in values)
        if not matched and self.seen >= WARN_AFTER:
            tasks = " or ".join(sorted(map(repr, self.tasks)))
            seen = ", ".join(sorted(self.values)[:20])
            log.warning(
                "%r has scored none of the %d completions so far: no row's %r was %s; the values seen "
                "were %s. Is the task named as the data names it (or the data sorted by task, unshuffled)?",
                self, self.seen, self.column, tasks, seen,
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"TaskReward({describe(self.reward)} on {self.column} in {sorted(self.tasks)})"


@runtime_checkable
class OnDevice(Protocol):
    """A reward that holds a model (``RewardModel``, an ``nn.Module``): moved to the policy's device."""

    def to(self, device: Any) -> Any: ...


def device_rewards(functions: Sequence[Any]) -> list[OnDevice]:
    """The rewards among ``functions`` that hold a model, those a ``TaskReward`` routes to included."""
    inner = [fn.reward if isinstance(fn, TaskReward) else fn for fn in functions]
    return [fn for fn in inner if isinstance(fn, OnDevice)]
