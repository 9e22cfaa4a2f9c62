"""Preference losses against hand-computed values, their edge cases and the weighted (MPO) combination."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.preference import (
    LOSS_TYPES,
    SMOOTHED,
    PreferenceInputs,
    RunningMean,
    bco_pair_loss,
    hinge_loss,
    ipo_loss,
    logratio_margin,
    online_pair_loss,
    reward_accuracy,
    robust_loss,
    sft_nll_loss,
    sigmoid_loss,
    weighted_preference_loss,
)


def softplus(x: float) -> float:
    """-logσ(-x) = log(1 + e^x), written out for the expected values."""
    return math.log1p(math.exp(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def make_inputs(requires_grad: bool = False) -> PreferenceInputs:
    # Example 0: ρ⁺ = -1 - (-2) = 1, ρ⁻ = -3 - (-2.5) = -0.5, Δ = 1.5; lengths 2 and 4.
    # Example 1: ρ⁺ = -4 - (-3) = -1, ρ⁻ = -2 - (-4) = 2, Δ = -3 (the policy prefers the rejected one).
    return PreferenceInputs(
        policy_chosen_logps=t(-1.0, -4.0).requires_grad_(requires_grad),
        policy_rejected_logps=t(-3.0, -2.0).requires_grad_(requires_grad),
        ref_chosen_logps=t(-2.0, -3.0),
        ref_rejected_logps=t(-2.5, -4.0),
        chosen_lengths=torch.tensor([2, 4]),
        rejected_lengths=torch.tensor([4, 1]),
    )


def test_margin_is_difference_of_log_ratios():
    inp = make_inputs()
    margin = logratio_margin(
        inp.policy_chosen_logps, inp.policy_rejected_logps, inp.ref_chosen_logps, inp.ref_rejected_logps
    )
    torch.testing.assert_close(margin, t(1.5, -3.0))


def test_sigmoid_matches_hand_computation():
    # β = 0.5: βΔ = 0.75 and -1.5; -logσ(x) = log(1 + e^-x).
    expected = t(softplus(-0.75), softplus(1.5))
    torch.testing.assert_close(sigmoid_loss(t(1.5, -3.0), beta=0.5), expected)


def test_sigmoid_label_smoothing_is_cdpo():
    # ε = 0.1, βΔ = 0.75: 0.9·log(1 + e^-0.75) + 0.1·log(1 + e^0.75).
    expected = 0.9 * softplus(-0.75) + 0.1 * softplus(0.75)
    torch.testing.assert_close(sigmoid_loss(t(1.5), beta=0.5, label_smoothing=0.1), t(expected))


def test_cdpo_pulls_back_a_huge_margin():
    # With ε > 0 the loss grows like ε·βΔ for large Δ, so the gradient pushes Δ back (finite optimum).
    margin = t(100.0).requires_grad_()
    sigmoid_loss(margin, beta=1.0, label_smoothing=0.1).sum().backward()
    assert margin.grad is not None and margin.grad.item() == pytest.approx(0.1, rel=1e-6)


def test_robust_matches_hand_computation():
    # ε = 0.1, βΔ = 0.75: (0.9·log(1 + e^-0.75) - 0.1·log(1 + e^0.75)) / 0.8.
    expected = (0.9 * softplus(-0.75) - 0.1 * softplus(0.75)) / 0.8
    torch.testing.assert_close(robust_loss(t(1.5), beta=0.5, label_smoothing=0.1), t(expected))


def test_robust_at_zero_smoothing_equals_sigmoid():
    margin = t(1.5, -3.0, 0.0, 7.0)
    torch.testing.assert_close(robust_loss(margin, 0.3, 0.0), sigmoid_loss(margin, 0.3))


def test_hinge_matches_hand_computation():
    # β = 0.5: relu(1 - 0.75) = 0.25, relu(1 + 1.5) = 2.5, relu(1 - 2) = 0.
    torch.testing.assert_close(hinge_loss(t(1.5, -3.0, 4.0), beta=0.5), t(0.25, 2.5, 0.0))


def test_ipo_uses_token_averaged_log_probs():
    # Example 0: ρ̄⁺ = (-1 + 2) / 2 = 0.5, ρ̄⁻ = (-3 + 2.5) / 4 = -0.125, Δ̄ = 0.625.
    # Example 1: ρ̄⁺ = (-4 + 3) / 4 = -0.25, ρ̄⁻ = (-2 + 4) / 1 = 2, Δ̄ = -2.25.
    # β = 0.5 → target 1/(2β) = 1: (0.625 - 1)² = 0.140625, (-2.25 - 1)² = 10.5625; mean 5.3515625.
    # With summed log-probs it would be ((1.5 - 1)² + (-3 - 1)²) / 2 = 8.125 instead.
    torch.testing.assert_close(ipo_loss(t(0.625, -2.25), beta=0.5), t(0.140625, 10.5625))
    total, metrics = weighted_preference_loss(["ipo"], None, make_inputs(), beta=0.5)
    assert total.item() == pytest.approx(5.3515625)
    assert metrics["loss/ipo"].item() == pytest.approx(5.3515625)


def test_online_dpo_ipo_uses_summed_log_probs_as_trls_online_trainer():
    # Summed margins Δ = 1.5 and -3, β = 0.5: (1.5 - 1)² = 0.25, (-3 - 1)² = 16. It used DPOTrainer's
    # token average (0.140625, 10.5625), whose optimum is |y| times further from the reference.
    torch.testing.assert_close(online_pair_loss("ipo", make_inputs(), beta=0.5), t(0.25, 16.0))
    torch.testing.assert_close(
        online_pair_loss("sigmoid", make_inputs(), beta=0.5), sigmoid_loss(t(1.5, -3.0), beta=0.5)
    )
    with pytest.raises(ValueError, match="sigmoid or ipo"):
        online_pair_loss("hinge", make_inputs(), beta=0.5)


def test_bco_pair_matches_hand_computation():
    # β = 0.5, δ = 0.1, ρ⁺ = 1, ρ⁻ = -0.5: -logσ(0.5 - 0.1) - logσ(-(-0.25 - 0.1)) = sp(-0.4) + sp(-0.35).
    expected = softplus(-0.4) + softplus(-0.35)
    torch.testing.assert_close(bco_pair_loss(t(1.0), t(-0.5), beta=0.5, delta=0.1), t(expected))
    # δ = 0 is the simplified form -logσ(βρ⁺) - logσ(-βρ⁻) = sp(-0.5) + sp(-0.25).
    torch.testing.assert_close(bco_pair_loss(t(1.0), t(-0.5), beta=0.5), t(softplus(-0.5) + softplus(-0.25)))


def test_sft_is_per_example_mean_nll_of_chosen():
    # -(-1)/2 = 0.5, -(-4)/4 = 1; a zero length counts as one token instead of dividing by zero.
    torch.testing.assert_close(sft_nll_loss(t(-1.0, -4.0, -3.0), torch.tensor([2, 4, 0])), t(0.5, 1.0, 3.0))


def test_sft_token_mean_is_trls_mean_over_all_chosen_tokens():
    # TRL: Σ -logp⁺ / Σ |y⁺| = (2 + 9) / (1 + 3) = 2.75; per example it is mean(2, 3) = 2.5.
    logps, lengths = t(-2.0, -9.0), torch.tensor([1, 3])
    assert sft_nll_loss(logps, lengths).mean().item() == pytest.approx(2.5)
    assert sft_nll_loss(logps, lengths, "token_mean").mean().item() == pytest.approx(2.75)
    # A normaliser from outside (all ranks' tokens): Σ_local -logp⁺ / num_tokens.
    assert sft_nll_loss(logps, lengths, "token_mean", num_tokens=11.0).mean().item() == pytest.approx(1.0)
    # Equal lengths: both normalisations agree.
    same = torch.tensor([2, 2])
    torch.testing.assert_close(sft_nll_loss(logps, same, "token_mean"), sft_nll_loss(logps, same))


def test_mpo_with_token_mean_differs_only_in_the_sft_term():
    inp = make_inputs()  # chosen log-probs -1, -4 over 2 and 4 tokens
    per_example, m1 = weighted_preference_loss(["sigmoid", "sft"], [0.8, 1.0], inp, beta=0.5)
    token_mean, m2 = weighted_preference_loss(
        ["sigmoid", "sft"], [0.8, 1.0], inp, beta=0.5, sft_normalization="token_mean"
    )
    assert m1["loss/sft"].item() == pytest.approx((0.5 + 1.0) / 2)
    assert m2["loss/sft"].item() == pytest.approx(5.0 / 6.0)
    assert (token_mean - per_example).item() == pytest.approx(5.0 / 6.0 - 0.75)
    with pytest.raises(ValueError, match="sft_normalization must be one of"):
        weighted_preference_loss(["sft"], None, inp, sft_normalization="tokens")


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_equal_log_probs(beta: float):
    zero = t(0.0, 0.0)
    ln2 = math.log(2.0)
    torch.testing.assert_close(sigmoid_loss(zero, beta), t(ln2, ln2))
    torch.testing.assert_close(sigmoid_loss(zero, beta, 0.3), t(ln2, ln2))
    torch.testing.assert_close(robust_loss(zero, beta, 0.3), t(ln2, ln2))  # ((1-ε) - ε) ln2 / (1-2ε)
    torch.testing.assert_close(hinge_loss(zero, beta), t(1.0, 1.0))
    torch.testing.assert_close(ipo_loss(zero, beta), t(1 / (4 * beta**2), 1 / (4 * beta**2)))
    torch.testing.assert_close(bco_pair_loss(zero, zero, beta), t(2 * ln2, 2 * ln2))


def test_mpo_preset_equals_weighted_sum_of_components():
    inp = make_inputs()
    beta, delta = 0.5, 0.2
    total, metrics = weighted_preference_loss(
        ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], inp, beta=beta, bco_delta=delta
    )
    margin = t(1.5, -3.0)
    sig = sigmoid_loss(margin, beta).mean()
    bco = bco_pair_loss(t(1.0, -1.0), t(-0.5, 2.0), beta, delta).mean()
    sft = sft_nll_loss(inp.policy_chosen_logps, inp.chosen_lengths).mean()
    torch.testing.assert_close(total, 0.8 * sig + 0.2 * bco + 1.0 * sft)
    # The same total written out by hand.
    sig_hand = (softplus(-0.75) + softplus(1.5)) / 2
    bco_hand = (
        softplus(-(0.5 - 0.2)) + softplus(-0.25 - 0.2) + softplus(-(-0.5 - 0.2)) + softplus(1.0 - 0.2)
    ) / 2
    sft_hand = (0.5 + 1.0) / 2
    assert total.item() == pytest.approx(0.8 * sig_hand + 0.2 * bco_hand + sft_hand, rel=1e-12)
    assert metrics["loss/sigmoid"].item() == pytest.approx(sig_hand)
    assert metrics["loss/bco_pair"].item() == pytest.approx(bco_hand)
    assert metrics["loss/sft"].item() == pytest.approx(sft_hand)


def test_default_weights_are_one_and_label_smoothing_reaches_sigmoid():
    inp = make_inputs()
    total, _ = weighted_preference_loss(["sigmoid", "hinge"], None, inp, beta=0.5, label_smoothing=0.1)
    margin = t(1.5, -3.0)
    expected = sigmoid_loss(margin, 0.5, 0.1).mean() + hinge_loss(margin, 0.5).mean()
    torch.testing.assert_close(total, expected)


def test_metrics_follow_trl_names_and_are_detached():
    inp = make_inputs(requires_grad=True)
    total, metrics = weighted_preference_loss(["sigmoid"], [1.0], inp, beta=0.5)
    # Chosen rewards β·ρ⁺ = 0.5, -0.5; rejected -0.25, 1.0; only example 0 ranks chosen higher.
    expected = {
        "rewards/chosen": 0.0,
        "rewards/rejected": 0.375,
        "rewards/margins": -0.375,
        "rewards/accuracies": 0.5,
        "logps/chosen": -2.5,
        "logps/rejected": -2.5,
        "loss/sigmoid": (softplus(-0.75) + softplus(1.5)) / 2,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key].item() == pytest.approx(value), key
        assert not metrics[key].requires_grad, key
    assert total.requires_grad


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "bco_pair", "ipo", "sft"])
def test_raising_chosen_logp_lowers_the_loss(loss_type: str):
    # Every example here sits on the "wrong" side, so no loss is flat (hinge) or past its target (ipo).
    inp = PreferenceInputs(
        policy_chosen_logps=t(-5.0, -6.0).requires_grad_(),
        policy_rejected_logps=t(-2.0, -1.0).requires_grad_(),
        ref_chosen_logps=t(-3.0, -3.0),
        ref_rejected_logps=t(-3.0, -3.0),
        chosen_lengths=torch.tensor([3, 3]),
        rejected_lengths=torch.tensor([3, 3]),
    )
    smoothing = 0.1 if loss_type in SMOOTHED else 0.0  # the others take none
    total, _ = weighted_preference_loss([loss_type], None, inp, beta=0.1, label_smoothing=smoothing)
    total.backward()
    assert inp.policy_chosen_logps.grad is not None and (inp.policy_chosen_logps.grad < 0).all()
    if loss_type != "sft":
        assert inp.policy_rejected_logps.grad is not None and (inp.policy_rejected_logps.grad > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_margins_give_finite_loss_and_gradients(dtype: torch.dtype):
    # βΔ = ±1e4 with β = 0.1; log(sigmoid(-1e4)) would be log(0) = -inf.
    inp = PreferenceInputs(
        policy_chosen_logps=torch.tensor([5e4, -5e4], dtype=dtype, requires_grad=True),
        policy_rejected_logps=torch.tensor([-5e4, 5e4], dtype=dtype, requires_grad=True),
        ref_chosen_logps=torch.zeros(2, dtype=dtype),
        ref_rejected_logps=torch.zeros(2, dtype=dtype),
        chosen_lengths=torch.tensor([1, 1]),
        rejected_lengths=torch.tensor([1, 1]),
    )
    for loss_type in LOSS_TYPES:
        inp.policy_chosen_logps.grad = None
        inp.policy_rejected_logps.grad = None
        total, metrics = weighted_preference_loss(
            [loss_type],
            None,
            inp,
            beta=0.1,
            label_smoothing=0.2 if loss_type in SMOOTHED else 0.0,
            bco_delta=0.5,
        )
        total.backward()
        assert torch.isfinite(total), loss_type
        assert all(torch.isfinite(v) for v in metrics.values()), loss_type
        assert torch.isfinite(inp.policy_chosen_logps.grad).all(), loss_type
        rejected_grad = inp.policy_rejected_logps.grad  # None for sft, which ignores the rejected answer
        assert rejected_grad is None or torch.isfinite(rejected_grad).all(), loss_type
    # The wrong-side example costs exactly |βΔ| = 1e4 under sigmoid; the right-side one costs ~0.
    torch.testing.assert_close(sigmoid_loss(torch.tensor([1e5, -1e5]), 0.1), torch.tensor([0.0, 1e4]))


def test_unknown_loss_type_names_it_and_lists_valid_ones():
    with pytest.raises(ValueError, match=r"\['dpo'\].*sigmoid.*bco_pair"):
        weighted_preference_loss(["sigmoid", "dpo"], None, make_inputs())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_types": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights has 1 entries"),
        ({"loss_types": []}, "empty"),
        ({"loss_types": ["sft", "sft"]}, "duplicates"),
        ({"loss_types": ["robust"], "label_smoothing": 0.5}, r"\[0, 0.5\)"),
        ({"loss_types": ["sigmoid"], "label_smoothing": -0.1}, r"\[0, 0.5\)"),
        ({"loss_types": ["ipo"], "beta": 0.0}, "beta must be > 0"),
        # ipo, hinge, bco_pair and sft take no smoothing: it would be dropped without a word
        ({"loss_types": ["ipo", "sft"], "label_smoothing": 0.1}, r"label_smoothing=0.1.*\['ipo', 'sft'\]"),
        ({"loss_types": ["hinge"], "label_smoothing": 0.2}, "only to sigmoid and robust"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs: dict, match: str):
    kwargs = {"loss_weights": None, **kwargs}
    with pytest.raises(ValueError, match=match):
        weighted_preference_loss(inputs=make_inputs(), **kwargs)


def test_bare_string_loss_type_is_rejected():
    with pytest.raises(TypeError, match=r"\['sigmoid'\]"):
        weighted_preference_loss("sigmoid", None, make_inputs())  # type: ignore[arg-type]


def test_mismatched_shapes_are_rejected():
    inp = make_inputs()
    inp.ref_rejected_logps = t(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="ref_rejected_logps has shape"):
        weighted_preference_loss(["sigmoid"], None, inp)


def test_running_mean_is_cumulative_and_checkpointed():
    running = RunningMean()
    assert running().item() == 0.0
    running.update(torch.tensor([1.0, 3.0]))  # mean 2 over 2 values
    assert running.update(torch.tensor([5.0, 7.0, 9.0, 11.0])).item() == pytest.approx(6.0)  # 36 / 6
    assert running.update(torch.tensor([])).item() == pytest.approx(6.0)
    restored = RunningMean()
    restored.load_state_dict(running.state_dict())
    assert (restored().item(), restored.count.item()) == (pytest.approx(6.0), 6)
    # Casting the module (bf16-true training) must not touch the integer count.
    assert restored.to(torch.bfloat16).count.dtype == torch.long


def test_running_mean_keeps_moving_when_the_module_is_cast_to_bfloat16():
    # The mean was cast too: once n / count put an update under half a bf16 ulp, δ stopped at 1.0.
    running = RunningMean().to(torch.bfloat16)
    for step in range(2000):
        running.update(torch.full((64,), 1.0 if step < 1000 else 2.0, dtype=torch.bfloat16))
    assert running.mean.dtype == torch.float32 and running().item() == pytest.approx(1.5, abs=1e-5)


def test_running_mean_keeps_its_float32_digits_through_a_cast_after_a_restore():
    # Lightning restores a checkpoint before the strategy casts the module ("bf16-true"): a resumed δ of
    # 0.123456789 came back as bfloat16's 0.12353515625, a silent change to the bco_pair loss.
    running = RunningMean()
    running.update(torch.tensor([0.123456789]))
    restored = RunningMean()
    restored.load_state_dict(running.state_dict())
    restored.to(torch.bfloat16)
    assert restored.mean.dtype == torch.float32 and restored().item() == running().item()


def test_running_mean_feeds_bco_delta():
    running = RunningMean()
    inp = make_inputs()
    rewards = 0.5 * torch.cat(
        [inp.policy_chosen_logps - inp.ref_chosen_logps, inp.policy_rejected_logps - inp.ref_rejected_logps]
    )
    delta = running.update(rewards)  # (0.5 - 0.5 - 0.25 + 1.0) / 4 = 0.1875
    assert delta.item() == pytest.approx(0.1875)
    total, _ = weighted_preference_loss(["bco_pair"], None, inp, beta=0.5, bco_delta=delta)
    expected = bco_pair_loss(t(1.0, -1.0), t(-0.5, 2.0), 0.5, 0.1875).mean()
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)


def test_reward_accuracy_counts_a_tie_half():
    # Chosen above, below, tied (policy == reference), and a tie at a nonzero reward.
    torch.testing.assert_close(reward_accuracy(t(0.3, -0.2, 0.0, 0.0)), t(1.0, 0.0, 0.5, 0.5))
    # DPO's metric is this function: margins Δ = 2.5 (hit), -3 (miss), 0 (tie) -> (1 + 0 + 0.5) / 3.
    inp = PreferenceInputs(t(-1.0, -2.0, -4.0), t(-3.0, -1.0, -4.0), t(-1.5, -2.0, -3.0), t(-1.0, -4.0, -3.0),
                           t(2, 2, 2), t(2, 2, 2))  # fmt: skip
    _, metrics = weighted_preference_loss(["sigmoid"], None, inp, beta=0.1)
    assert metrics["rewards/accuracies"].item() == pytest.approx(0.5)
