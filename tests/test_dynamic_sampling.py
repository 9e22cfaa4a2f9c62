"""DAPO's dynamic sampling: the filter, the rounds, filling, counts, settings errors, and exact resume."""

from __future__ import annotations

import functools

import pytest
import torch
from online_helpers import FixedGenerator

from lightning_vlm.generation.base import Rollouts
from lightning_vlm.methods.dynamic_sampling import (
    DynamicSampling,
    any_reward_std_filter,
    collect,
    concat_rollouts,
    select_groups,
    zero_std_filter,
)

G = 2


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_zero_std_filter_keeps_groups_whose_valid_rewards_differ():
    empty = torch.zeros(3, 0)
    assert zero_std_filter(t(1.0, 0.0, 1.0), empty)
    assert not zero_std_filter(t(1.0, 1.0, 1.0), empty)  # all right: no signal
    assert not zero_std_filter(t(0.0, 0.0), empty)  # all wrong
    assert not zero_std_filter(t(1.0, float("nan"), float("nan")), empty)  # one valid reward: no std
    assert zero_std_filter(t(1.0, float("nan"), 0.5), empty)


def _rollouts(rows: list[dict]) -> Rollouts:
    """G completions per row whose text is the row's reward pattern (e.g. "10" = rewards 1, 0)."""
    texts = [ch for r in rows for ch in r["pattern"]]
    return Rollouts(
        rows=rows,
        completion_ids=[[i] for i in range(len(texts))],
        completion_texts=texts,
        truncated=[False] * len(texts),
        num_generations=G,
        logprobs=[[-0.5] for _ in texts],
    )


def _collect(patterns: list[str], rounds: int, filter_="zero_std", enabled=True, everyone=None):
    pool = [{"pattern": p, "id": i} for i, p in enumerate(patterns)]
    calls: list[tuple[list[int], int]] = []

    def generate(rows, round_index):
        calls.append(([r["id"] for r in rows], round_index))
        return _rollouts(rows)

    def score(rollouts):
        return torch.tensor([[float(c)] for c in rollouts.completion_texts])

    settings = DynamicSampling(enabled=enabled, filter=filter_, max_num_gen_batches=rounds)
    done = everyone or (lambda d: d)
    rollouts, per_function, counts = collect(pool, settings, generate, score, lambda r, p: p.sum(-1), done)
    return rollouts, per_function, counts, calls


def test_under_gdpo_zero_std_keeps_a_group_whose_weighted_rewards_vary_though_the_totals_tie(tiny_path):
    per_function = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # totals with weights 1 and 0.5: 1 and 1
    weights = t(1.0, 0.5)
    totals = per_function @ weights
    assert not zero_std_filter(totals, per_function)
    assert any_reward_std_filter(totals, per_function, weights)  # GDPO's advantages here are ±1.41
    # a reward that varies but weighs 0 does not count; nor does one completion's valid value alone
    assert not any_reward_std_filter(t(1.0, 1.0), torch.tensor([[1.0, 0.0], [1.0, 2.0]]), t(1.0, 0.0))
    assert not any_reward_std_filter(
        t(1.0, 1.0), torch.tensor([[1.0, float("nan")], [1.0, 2.0]]), t(1.0, 1.0)
    )

    from lightning_vlm.methods.grpo import GRPO
    from lightning_vlm.models.vlm import VLM

    def group_filter(aggregation: str):
        module = GRPO(VLM(tiny_path()), optimizer=torch.optim.SGD, reward_funcs=["accuracy_reward", "length_reward"],
                      reward_weights=[1.0, 0.5], multi_objective_aggregation=aggregation,
                      dynamic_sampling={"enabled": True})  # fmt: skip
        return module.dynamic_sampling.group_filter

    assert group_filter("normalize_then_sum")(totals, per_function)  # GRPO picks GDPO's version
    assert not group_filter("sum_then_normalize")(totals, per_function)


def test_rounds_top_up_only_the_missing_groups_and_stop_when_full():
    # Pool of 6 prompts, up to 3 rounds, 2 groups per step: round 0 keeps one ("10"), so rounds 1 and 2
    # draw one prompt each ("00" is filtered, "01" kept): then the step is full.
    rollouts, per_function, counts, calls = _collect(["10", "11", "00", "01", "11", "10"], rounds=3)
    assert calls == [([0, 1], 0), ([2], 1), ([3], 2)]
    assert [r["id"] for r in rollouts.rows] == [0, 3]
    assert rollouts.completion_texts == ["1", "0", "0", "1"]
    assert per_function.flatten().tolist() == [1.0, 0.0, 0.0, 1.0]
    assert rollouts.logprobs == [[-0.5]] * 4
    assert counts == {"rounds": 3.0, "generated": 8.0, "groups_kept": 2.0, "groups_filtered": 2.0,
                      "groups_filled": 0.0}  # fmt: skip


def test_a_used_up_pool_fills_with_the_latest_filtered_groups():
    rollouts, per_function, counts, calls = _collect(["11", "00", "10", "11"], rounds=2)
    assert len(calls) == 2
    # kept "10" (id 2) first, then the latest filtered group (id 3): the step keeps its size
    assert [r["id"] for r in rollouts.rows] == [2, 3]
    assert per_function.flatten().tolist() == [1.0, 0.0, 1.0, 1.0]
    assert counts["groups_filled"] == 1.0 and counts["groups_kept"] == 1.0


def test_extra_kept_groups_beyond_a_round_are_dropped_in_order():
    rollouts, _, counts, calls = _collect(["10", "11", "01", "10"], rounds=2)
    assert [r["id"] for r in rollouts.rows] == [0, 2]
    assert counts["groups_kept"] == 2.0 and len(calls) == 2


def test_all_ranks_run_the_same_rounds():
    # This rank is full after round 0, but another rank is not: it keeps generating with them.
    answers = iter([False, True])
    rollouts, _, counts, calls = _collect(
        ["10", "01", "11", "11"], rounds=2, everyone=lambda d: next(answers)
    )
    assert len(calls) == 2 and [r["id"] for r in rollouts.rows] == [0, 1]
    # Round 1 drew one prompt only to stay in step: it was generated, but its tie is no filtering.
    assert counts["generated"] == 6.0 and counts["groups_filtered"] == 0.0


def test_a_group_with_no_completion_left_in_the_loss_is_dropped_whatever_its_rewards(tiny_path):
    # mask_truncated_completions: a group whose completions were all cut off has no gradient, though its
    # rewards differ; one with a finished completion still teaches (its advantage is not 0).
    pool = [{"pattern": p, "id": i} for i, p in enumerate(["10", "01", "10", "10"])]
    cut = {0: [True, True], 1: [True, False], 2: [True, True], 3: [False, False]}

    def generate(rows, round_index):
        rollouts = _rollouts(rows)
        rollouts.truncated = [t for r in rows for t in cut[r["id"]]]
        return rollouts

    def score(rollouts):
        return torch.tensor([[float(c)] for c in rollouts.completion_texts])

    settings = DynamicSampling(enabled=True, max_num_gen_batches=2)
    finished = lambda r: [not t for t in r.truncated]  # noqa: E731
    rollouts, _, counts = collect(pool, settings, generate, score, lambda r, p: p.sum(-1), bool, finished)
    # Round 0 keeps group 1 and drops group 0; round 1 draws group 2, all cut off too, which fills the step.
    assert [r["id"] for r in rollouts.rows] == [1, 2]
    assert counts["groups_kept"] == 1 and counts["groups_filtered"] == 2 and counts["groups_filled"] == 1
    # Without the mask, groups 0 and 1 pass the filter in the first round.
    rollouts, _, counts = collect(pool, settings, generate, score, lambda r, p: p.sum(-1), bool)
    assert [r["id"] for r in rollouts.rows] == [0, 1] and counts["groups_filtered"] == 0
    # The online methods tell collect which completions their loss keeps.
    from lightning_vlm.methods.grpo import GRPO
    from lightning_vlm.models.vlm import VLM

    vlm, sample = VLM(tiny_path()), generate(pool[:2], 0)
    for masked, expected in ((True, [False, False, False, True]), (False, [True] * 4)):
        module = GRPO(vlm, optimizer=torch.optim.SGD, reward_funcs=["accuracy_reward"],
                      mask_truncated_completions=masked, dynamic_sampling={"enabled": True})  # fmt: skip
        assert module.in_loss(sample) == expected


def test_a_custom_filter_sees_rewards_and_per_function():
    seen = []

    def keep_if_any_right(rewards, per_function):
        seen.append(per_function.shape)
        return bool((rewards > 0).any())

    rollouts, _, counts, _ = _collect(["11", "00", "01", "00"], rounds=2, filter_=keep_if_any_right)
    assert [r["id"] for r in rollouts.rows] == [0, 2]  # "11" and, topped up, "01"
    assert seen == [torch.Size([2, 1])] * 3


def test_disabled_generates_the_whole_pool_once():
    rollouts, _, counts, calls = _collect(["11", "00"], rounds=2, enabled=False)
    assert calls == [([0, 1], 0)] and counts == {} and len(rollouts) == 4


def test_select_and_concat_keep_groups_whole():
    a = _rollouts([{"pattern": "10", "id": 0}, {"pattern": "01", "id": 1}])
    b = _rollouts([{"pattern": "11", "id": 2}])
    both = concat_rollouts([select_groups(a, [1]), b])
    assert [r["id"] for r in both.rows] == [1, 2] and both.completion_texts == ["0", "1", "1", "1"]
    assert both.prompt_index == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"enabled": True, "max_num_gen_batches": 0}, "max_num_gen_batches must be an integer >= 2"),
        # one round: the filtered groups would fill the step back, training as without the filter
        ({"enabled": True, "max_num_gen_batches": 1}, "a single round leaves nothing to resample"),
        ({"max_num_gen_batches": 1}, "max_num_gen_batches must be an integer >= 2"),
        ({"enabled": True, "filter": "std"}, "filter 'std' is unknown"),
        ({"enabled": True, "rounds": 2}, r"unknown method.dynamic_sampling keys \['rounds'\]"),
        (True, r"method.dynamic_sampling must be a mapping such as \{enabled: true\}.*got True"),
        ("on", r"method.dynamic_sampling must be a mapping .*got 'on'"),
        ({"enabled": "no"}, "method.dynamic_sampling.enabled must be true or false, got 'no'"),
    ],
)
def test_bad_settings_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        DynamicSampling.of(value)


def test_a_mapping_turns_it_on_unless_it_says_otherwise():
    # {max_num_gen_batches: 5} was silently off (enabled defaulted to false)
    assert DynamicSampling.of({"max_num_gen_batches": 5}) == DynamicSampling(True, "zero_std", 5)
    assert DynamicSampling.of({}).enabled
    assert not DynamicSampling.of({"enabled": False, "max_num_gen_batches": 5}).enabled
    assert not DynamicSampling.of(None).enabled


def test_a_short_last_pool_runs_in_smaller_rounds():
    assert DynamicSampling(enabled=True, max_num_gen_batches=3).round_size(24) == 8
    assert DynamicSampling(enabled=True, max_num_gen_batches=3).round_size(16) == 6  # the epoch's last batch
    rollouts, _, counts, calls = _collect(["11", "10", "01", "11", "10"], rounds=2)  # 3 per step
    assert [ids for ids, _ in calls] == [[0, 1, 2], [3]] and [r["id"] for r in rollouts.rows] == [1, 2, 3]
    # a used-up pool starts over (new seeds: the round index), so every rank runs every round
    _, _, _, calls = _collect(["11", "11"], rounds=3)
    assert calls == [([0], 0), ([1], 1), ([0], 2)]


def test_describe_is_plain_values():
    keep = functools.partial(zero_std_filter)
    assert DynamicSampling(True, keep, 2).describe() == {
        "enabled": True, "filter": "zero_std_filter", "max_num_gen_batches": 2}  # fmt: skip
    assert DynamicSampling().describe()["filter"] == "zero_std"


def _constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


class AskedGroups(FixedGenerator):
    """From fixed rollouts, the groups of the prompts each round asks for (FixedGenerator returns all)."""

    def generate(self, rows, num_generations, sampling):
        self.calls += 1
        return select_groups(self.rollouts, [self.rollouts.rows.index(r) for r in rows])


# Two prompts in two rounds of one: without the penalty both groups tie (filtered, one fills the step);
# with it the first round's group teaches and the step is full.
@pytest.mark.parametrize(("penalty", "kept", "filtered"), [(None, 0.0, 2.0), (1.0, 1.0, 0.0)])
def test_online_dpo_filters_on_the_rewards_it_picks_pairs_by(tiny_path, penalty, kept, filtered):
    # Every answer scores 1, but each pair's first one ran out of tokens: missing_eos_penalty breaks the
    # tie, so the pair teaches (chosen: the one that ended) and dynamic sampling must keep it.
    from online_helpers import fit_steps, sample_rollouts, sgd

    from lightning_vlm.data.synthetic import synthetic_rows
    from lightning_vlm.methods.online_dpo import OnlineDPO
    from lightning_vlm.models.vlm import VLM

    vlm, rows = VLM(tiny_path("qwen2_5_vl")), synthetic_rows("prompt", 2, seed=3)
    rollouts = sample_rollouts(vlm, rows, 2, max_new_tokens=4)
    rollouts.truncated = [True, False, True, False]
    module = OnlineDPO(vlm, optimizer=sgd(1e-3), reward_funcs=[_constant_reward], missing_eos_penalty=penalty,
                       num_candidates=2, max_completion_length=4,
                       dynamic_sampling={"enabled": True, "max_num_gen_batches": 2})  # fmt: skip
    module.generator = AskedGroups(rollouts)
    metrics = fit_steps(module, rows).callback_metrics
    assert metrics["train/dynamic_sampling/groups_kept"] == kept
    assert metrics["train/dynamic_sampling/groups_filtered"] == filtered


def _first_of_each_pair_wins(completions, **kwargs):
    return [float(i % 2 == 0) for i in range(len(completions))]


# Each pair's first answer wins but ran out of tokens. Masked, it can be in no pair (compute_advantages
# drops such a pair): neither group can teach, and both are filtered; unmasked, the first round's teaches.
@pytest.mark.parametrize(("masked", "kept", "filtered"), [(False, 1.0, 0.0), (True, 0.0, 2.0)])
def test_online_dpo_under_the_mask_filters_out_a_group_with_one_finished_answer(
    tiny_path, masked, kept, filtered
):
    from online_helpers import fit_steps, sample_rollouts, sgd

    from lightning_vlm.data.synthetic import synthetic_rows
    from lightning_vlm.methods.online_dpo import OnlineDPO
    from lightning_vlm.models.vlm import VLM

    vlm, rows = VLM(tiny_path("qwen2_5_vl")), synthetic_rows("prompt", 2, seed=3)
    rollouts = sample_rollouts(vlm, rows, 2, max_new_tokens=4)
    rollouts.truncated = [True, False, True, False]
    module = OnlineDPO(vlm, optimizer=sgd(1e-3), reward_funcs=[_first_of_each_pair_wins], num_candidates=2,
                       max_completion_length=4, mask_truncated_completions=masked,
                       dynamic_sampling={"enabled": True, "max_num_gen_batches": 2})  # fmt: skip
    module.generator = AskedGroups(rollouts)
    metrics = fit_steps(module, rows).callback_metrics
    assert metrics["train/dynamic_sampling/groups_kept"] == kept
    assert metrics["train/dynamic_sampling/groups_filtered"] == filtered
