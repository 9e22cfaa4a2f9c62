"""Advantages, reward combination and RLOO baselines against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.advantages import (
    combine_rewards,
    group_advantages,
    kl_penalized_rewards,
    reward_stats,
    rloo_advantages,
)

NAN = float("nan")
EPS = 1e-4


def close(actual: torch.Tensor, expected: list[float]) -> None:
    """Assert elementwise closeness to a hand-written list."""
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6, equal_nan=True
    )


def test_group_scaling_divides_by_unbiased_group_std():
    rewards = torch.tensor([1.0, 3.0, 0.0, 4.0])
    # group means 2 and 2; unbiased stds sqrt((1+1)/1) = √2 and sqrt((4+4)/1) = √8
    s1, s2 = math.sqrt(2) + EPS, math.sqrt(8) + EPS
    close(group_advantages(rewards, 2, "group"), [-1 / s1, 1 / s1, -2 / s2, 2 / s2])


def test_batch_scaling_divides_by_std_of_all_rewards():
    rewards = torch.tensor([1.0, 3.0, 0.0, 4.0])
    # batch mean 2, deviations -1, 1, -2, 2 -> unbiased var 10/3
    s = math.sqrt(10 / 3) + EPS
    close(group_advantages(rewards, 2, "batch"), [-1 / s, 1 / s, -2 / s, 2 / s])


def test_none_scaling_is_dr_grpo_centering_only():
    close(group_advantages(torch.tensor([1.0, 3.0, 0.0, 4.0]), 2, "none"), [-1.0, 1.0, -2.0, 2.0])


def test_all_equal_group_gives_exact_zeros():
    # 0.1 is inexact in binary; without the constant-group guard this gives ~1e-4 instead of 0
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1])
    adv = group_advantages(rewards, 3, "group")
    d = 1.0 + EPS  # group 1: mean 2, unbiased std 1
    close(adv[:3], [-1 / d, 0.0, 1 / d])
    assert adv[3:].eq(0).all()
    for scale in ("batch", "none"):
        assert group_advantages(rewards, 3, scale)[3:].eq(0).all()


def test_missing_rewards_excluded_from_stats_and_get_zero():
    rewards = torch.tensor([1.0, NAN, 3.0, 5.0, NAN, 7.0, NAN, NAN])
    adv = group_advantages(rewards, 4, "group")
    # group 1 valid {1, 3, 5}: mean 3, unbiased std sqrt((4+0+4)/2) = 2; group 2 has one valid reward
    d = 2.0 + EPS
    close(adv, [-2 / d, 0.0, 0.0, 2 / d, 0.0, 0.0, 0.0, 0.0])
    for scale in ("batch", "none"):
        out = group_advantages(rewards, 4, scale)
        assert not out.isnan().any() and out[[1, 4, 5, 6, 7]].eq(0).all()
    # batch std over the 4 valid rewards {1, 3, 5, 7}: mean 4, var (9+1+1+9)/3
    s = math.sqrt(20 / 3) + EPS
    close(group_advantages(rewards, 4, "batch")[[0, 3]], [-2 / s, 2 / s])


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, "std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_generations=3"):
        group_advantages(torch.zeros(4), 3)


def test_combine_rewards_weights_and_none():
    per_function = torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 3.0]])
    # row 0: 2·1 (second function None); row 1: every function None -> missing; row 2: 2·0.5 + 0.5·3
    close(combine_rewards(per_function, torch.tensor([2.0, 0.5])), [2.0, NAN, 2.5])
    close(combine_rewards(per_function), [1.0, NAN, 3.5])


def test_combined_missing_reward_flows_to_zero_advantage():
    per_function = torch.tensor([[1.0, NAN], [NAN, NAN], [3.0, 2.0], [0.0, 0.0]])
    adv = group_advantages(combine_rewards(per_function), 4, "none")
    # valid rewards 1, 5, 0: mean 2
    close(adv, [-1.0, 0.0, 3.0, -2.0])


def test_reward_stats_ignore_nan():
    mean, std = reward_stats(torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 3.0]]))
    close(mean, [0.75, 3.0])
    close(std, [math.sqrt(0.125), 0.0])  # (0.25² + 0.25²) / (2 - 1); one valid value -> 0


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1.0, 3.0], [1 - 3, 3 - 1]),  # G=2: the baseline is the other sample
        ([1.0, 2.0, 6.0], [1 - 8 / 2, 2 - 7 / 2, 6 - 3 / 2]),  # G=3: (9 - r_i) / 2
        ([0.0, 1.0, 2.0, 5.0], [0 - 8 / 3, 1 - 7 / 3, 2 - 6 / 3, 5 - 3 / 3]),  # G=4: (8 - r_i) / 3
    ],
)
def test_rloo_leave_one_out(rewards: list[float], expected: list[float]):
    close(rloo_advantages(torch.tensor(rewards), len(rewards)), expected)


def test_rloo_normalize_and_groups():
    adv = rloo_advantages(torch.tensor([1.0, 3.0, 0.0, 4.0]), 2, normalize=True)
    # raw [-2, 2, -4, 4]: mean 0, unbiased var (4+4+16+16)/3
    s = math.sqrt(40 / 3) + EPS
    close(adv, [-2 / s, 2 / s, -4 / s, 4 / s])


def test_rloo_missing_reward_left_out_of_baselines():
    close(rloo_advantages(torch.tensor([1.0, NAN, 5.0, NAN, 2.0, NAN]), 3), [-4.0, 0.0, 4.0, 0.0, 0.0, 0.0])


def test_rloo_needs_two_generations():
    with pytest.raises(ValueError, match="num_generations >= 2"):
        rloo_advantages(torch.tensor([1.0, 2.0]), 1)


def test_kl_penalized_rewards_sum_masked_k1():
    rewards = torch.tensor([1.0, 2.0])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = kl_penalized_rewards(rewards, old, ref, mask, beta=0.1)
    # KL sums: row 0 = 0.5 + 0 (the -3 vs -9 token is padding), row 1 = -0.5 + 0 + 0
    close(out, [1.0 - 0.1 * 0.5, 2.0 + 0.1 * 0.5])
    assert out.grad_fn is None  # the penalty shapes the reward, it is not differentiated
