"""RLOO's sequence-level clipped loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.rloo import mean_token_kl, rloo_loss, sequence_log_ratio


def test_sequence_log_ratio_is_the_masked_sum():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    old = torch.tensor([[-1.5, -2.0, -9.0], [-1.0, -0.7, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert sequence_log_ratio(logps, old, mask).tolist() == pytest.approx([0.5, 0.7])


def test_clipping_uses_the_summed_ratio_at_both_ends():
    # seq 0: log s = 0.5 (s = e^0.5 ≈ 1.65 > 1.2) with A > 0 -> clipped at 1.2: loss -1.2·A.
    # seq 1: log s = -0.7 (s ≈ 0.50 < 0.8) with A < 0 -> clipped at 0.8: loss 0.8·|A|.
    # seq 2: log s = 0.1 inside the range, A = 2 -> -e^0.1·2.
    logps = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-0.5, -0.4]])
    old = torch.tensor([[-1.25, -2.25], [-0.65, -0.65], [-0.55, -0.45]])
    mask = torch.ones(3, 2)
    adv = torch.tensor([1.0, -3.0, 2.0])
    loss, stats = rloo_loss(logps, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    expected = (-1.2 * 1.0 + 0.8 * 3.0 - math.exp(0.1) * 2.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["clip_ratio/high"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/low"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/region"].item() == pytest.approx(2 / 3)  # their union, as GRPO logs it


def test_on_policy_gradient_is_reinforce_and_global_normaliser_splits():
    logps = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.1, -0.2]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, _ = rloo_loss(logps, None, adv, mask)
    loss.backward()
    # d/dlogp_t of -A·s/N with s = exp(Σ(logp - sg logp)) = 1: -A·mask/N.
    assert torch.allclose(logps.grad, -(adv.unsqueeze(-1) * mask) / 2)
    whole, _ = rloo_loss(logps.detach(), None, adv, mask)
    halves = sum(
        rloo_loss(logps.detach()[i : i + 1], None, adv[i : i + 1], mask[i : i + 1], num_sequences_in_batch=2)[
            0
        ]
        for i in range(2)
    )
    assert halves.item() == pytest.approx(whole.item())


def test_a_far_off_policy_sequence_is_capped_not_nan():
    # Σ_t log-ratio = 200 · 0.5 = 100 > 88: exp overflowed to inf, and inf · A = inf · 0 gave NaN for
    # seq 0 (advantage 0, a tied group) in the loss and the gradient. Capped at e^20: seq 0 adds 0 and
    # gets no gradient; seq 1 (A = 1 > 0) is clipped at 1 + ε as before.
    logps = torch.full((2, 200), -0.1, requires_grad=True)
    old = torch.full((2, 200), -0.6)
    loss, stats = rloo_loss(logps, old, torch.tensor([0.0, 1.0]), torch.ones(2, 200))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2 / 2)
    assert torch.isfinite(logps.grad).all() and not logps.grad.any()
    assert stats["ratio/max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    # A negative advantage on such a sequence: a large but finite loss (e^20 · |A| / N), not inf
    loss, _ = rloo_loss(logps.detach(), old, torch.tensor([-1.0, 1.0]), torch.ones(2, 200))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx((math.exp(20.0) - 1.2) / 2, rel=1e-5)


def test_the_logged_kl_is_per_token_as_trl_and_grpo_log_it():
    # It was the per-sequence sum averaged over sequences (masked ones as 0): 1.0 here, 5x TRL's.
    old, ref = torch.full((2, 5), -1.0), torch.full((2, 5), -1.2)
    mask = torch.ones(2, 5)
    assert mean_token_kl(old, ref, mask).item() == pytest.approx(0.2)
    mask[1] = 0  # a masked (truncated) sequence adds no token
    mask[0, 3:] = 0
    old[0, :3] = torch.tensor([-1.0, -2.0, -0.5])
    expected = ((-1.0 + 1.2) + (-2.0 + 1.2) + (-0.5 + 1.2)) / 3
    assert mean_token_kl(old, ref, mask).item() == pytest.approx(expected, rel=1e-5)
