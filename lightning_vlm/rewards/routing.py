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

from collections.abc import Sequence
from typing import Any

from lightning_vlm.rewards.scoring import describe, resolve_reward_function, reward_name


class TaskReward:
    """``reward`` on the rows whose ``column`` is ``task`` (or one of several tasks); ``None`` on the others."""

    def __init__(self, reward: Any, task: str | Sequence[str], column: str = "task") -> None:
        self.reward = resolve_reward_function(reward)
        self.tasks = frozenset([task] if isinstance(task, str) else [str(t) for t in task])
        if not self.tasks:
            raise ValueError("TaskReward needs at least one task")
        self.column = column
        # The wrapped reward's name, so logs read rewards/count_reward, not rewards/TaskReward.
        self.__name__ = reward_name(self.reward)

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        if self.column not in columns:
            raise ValueError(
                f"TaskReward({sorted(self.tasks)}) routes by the column {self.column!r}, which the data does "
                f"not have; the columns given were {sorted(columns)}"
            )
        n = len(completions)
        rows = [i for i, task in enumerate(columns[self.column]) if task in self.tasks]
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

    def __repr__(self) -> str:
        return f"TaskReward({describe(self.reward)} on {self.column} in {sorted(self.tasks)})"
