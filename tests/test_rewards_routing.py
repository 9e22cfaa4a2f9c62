"""TaskReward: a reward scores only its task's rows of a mixed batch; the others get None (left out of
the group statistics and of its metric), and it logs under the wrapped reward's name."""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch

from lightning_vlm.rewards import RewardScorer, TaskReward, count_reward, numeric_reward
from lightning_vlm.rewards.routing import WARN_AFTER


def test_scores_its_rows_and_none_elsewhere():
    reward = TaskReward(count_reward, task="count")
    out = reward(["two", "B", "three", "two"], solution=["two", "B", "two", "one"],
                 task=["count", "choice", "count", "count"])  # fmt: skip
    assert out == [1.0, None, 0.0, 0.0]
    assert reward(["B"], solution=["B"], task=["choice"]) == [None]


def test_only_the_routed_rows_reach_the_wrapped_reward():
    seen = {}

    def spy(completions, solution, trainer_state, **kwargs):
        seen.update(completions=completions, solution=solution, state=trainer_state, task=kwargs["task"])
        return [0.5] * len(completions)

    out = TaskReward(spy, task=["size", "text"])(
        ["a", "b", "c"], solution=["1", "2", "3"], task=["size", "count", "text"], trainer_state={"step": 4}
    )
    assert out == [0.5, None, 0.5]
    # per-row columns cut to the routed rows, other values passed as they are
    assert seen == {"completions": ["a", "c"], "solution": ["1", "3"], "state": {"step": 4},
                    "task": ["size", "text"]}  # fmt: skip


def test_names_settings_and_a_scorer_of_mixed_rows():
    size = TaskReward(functools.partial(numeric_reward, abs_tol=8), task="size")
    count = TaskReward("count_reward", task="count")
    assert size.__name__ == "numeric_reward" and "abs_tol=8" in repr(size) and "['size']" in repr(size)
    scorer = RewardScorer([count, size])
    scores, names = scorer(
        ["two", "50", "60"], {"solution": ["two", "45", "70"], "task": ["count", "size", "size"]}
    )
    assert names == ["count_reward", "numeric_reward"]
    expected = torch.tensor([[1.0, math.nan], [math.nan, 1.0], [math.nan, 0.0]])
    assert torch.allclose(scores, expected, equal_nan=True)
    assert scorer.total(scores).tolist() == [1.0, 1.0, 0.0]


def test_tasks_written_as_numbers_route_like_their_text():
    # Hydra reads `task: 1` as an int; a column may hold 1 or "1": both are task 1
    for task in (1, [1], "1", ["1"]):
        routed = TaskReward(count_reward, task=task)(
            ["two", "two", "two"], solution=[2, 2, 2], task=[1, "1", 2]
        )
        assert routed == [1.0, 1.0, None], task


def test_bad_uses_name_the_problem():
    with pytest.raises(ValueError, match="routes by the column 'task'.*columns given were \\['solution'\\]"):
        TaskReward(count_reward, task="count")(["two"], solution=["two"])
    with pytest.raises(ValueError, match="at least one task"):
        TaskReward(count_reward, task=[])
    with pytest.raises(ValueError, match="returned 1 rewards for 2 rows"):
        TaskReward(lambda completions, **kw: [1.0], task="a")(["x", "y"], task=["a", "a"])
    with pytest.raises(ValueError, match="neither a built-in reward"):
        TaskReward("no_such_reward", task="a")


def test_a_task_no_row_has_is_reported_once_with_the_values_seen(caplog):
    # "counting" is no kind of the data: without the warning every row would silently get None
    wrong, right = TaskReward(count_reward, task="counting"), TaskReward(count_reward, task="count_cells")
    n = WARN_AFTER // 3 + 1  # completions per call: the third call crosses WARN_AFTER
    batch = {"solution": ["two"] * n, "task": (["count_cells", 7, "choice"] * n)[:n]}
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.rewards.routing"):
        for _ in range(5):
            assert wrong(["two"] * n, **batch) == [None] * n
            right(["two"] * n, **batch)
    (record,) = caplog.records  # once, and none for the task that the rows have
    assert f"scored none of the {3 * n} completions" in record.message
    assert "no row's 'task' was 'counting'" in record.message
    assert "values seen were 'choice', 'count_cells', 7." in record.message  # 7 is an int, not '7'


def test_reward_columns_take_every_rows_keys():
    """Rows of a mixed JSONL keep their own keys: a column that the first row lacks (``solution`` on a
    caption row) still reaches the rewards, None where a row lacks it."""
    from lightning_vlm.generation.base import Rollouts
    from lightning_vlm.methods.rollout_buffer import reward_columns

    rows = [{"prompt": "p0", "task": "caption"}, {"prompt": "p1", "task": "count", "solution": "two"}]
    rollouts = Rollouts(rows, [[1], [2], [3], [4]], ["a", "b", "c", "d"], [False] * 4, num_generations=2)
    columns = reward_columns(rollouts)
    assert columns["solution"] == [None, None, "two", "two"]
    assert columns["task"] == ["caption", "caption", "count", "count"]
    assert columns["prompts"] == ["p0", "p0", "p1", "p1"] and "prompt" not in columns
    out = TaskReward(count_reward, task="count")(["a", "b", "two", "one"], **columns)
    assert out == [None, None, 1.0, 0.0]
