"""Clipped surrogate, GSPO ratios, k3 KL and aggregations against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.kl import k3_kl
from lightning_vlm.losses.policy import aggregate, clipped_surrogate, importance_ratio, policy_loss

L2 = math.log(2)


def close(actual: torch.Tensor, expected: list | float) -> None:
    """Assert closeness to a hand-written value."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def test_token_ratio_values_and_gradients():
    logps = torch.tensor([[math.log(0.5), math.log(0.25), -3.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25), -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    log_r = importance_ratio(logps, old, mask, "token")
    close(log_r[:, :2], [[L2, 0.0]])
    (torch.exp(log_r) * mask).sum().backward()
    close(logps.grad, [[2.0, 1.0, 0.0]])  # d r_t / d logp_t = r_t


def test_sequence_ratio_values_and_gradients_are_gspo():
    logps = torch.tensor([[math.log(0.5), math.log(0.25), -3.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25), -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    log_r = importance_ratio(logps, old, mask, "sequence")
    close(log_r, [[L2 / 2] * 3])  # (ln2 + 0) / 2 active tokens, on every token
    (torch.exp(log_r) * mask).sum().backward()
    close(logps.grad, [[math.sqrt(2), math.sqrt(2), 0.0]])  # s_i · ∇logp_t, s_i = 2^(1/2)


def test_sequence_level_stats_leave_out_sequences_without_tokens():
    # Rows 1 and 3 are fully masked (truncated under mask_truncated_completions): they have no ratio.
    # Row 0: log s = mean of token log-ratios = ln 2 (s = 2 > 1.2, A > 0: clipped high); row 2: s = 1. The mean is over rows 0 and 2
    # only; counting the empty rows as 0 gave ratio/mean 0.75 and clip_ratio/high 0.25.
    logps = torch.tensor([[L2, L2], [5.0, 5.0], [0.0, 0.0], [1.0, 1.0]])
    old = torch.zeros(4, 2)
    mask = torch.tensor([[1, 1], [0, 0], [1, 1], [0, 0]])
    _, stats = clipped_surrogate(logps, old, torch.ones(4), mask, level="sequence")
    close(stats["ratio/mean"], 1.5)
    close(stats["clip_ratio/high"], 0.5)
    _, empty = clipped_surrogate(logps, old, torch.ones(4), torch.zeros(4, 2), level="sequence")
    close(empty["ratio/mean"], 0.0)  # no active sequence at all: 0, not NaN


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_sequence_token_form_matches_broadcast_sequence_ratio(loss_type: str):
    # TRL broadcasts a differentiable s_i = exp(masked mean log-ratio) to every token; same gradient
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    logps_a = (old + 0.01 * torch.randn(3, 5)).requires_grad_()
    logps_b = logps_a.detach().clone().requires_grad_()
    per_token, _ = clipped_surrogate(logps_a, old, adv, mask, 0.2, 0.2, "sequence")
    aggregate(per_token, mask, loss_type).backward()
    seq = ((logps_b - old) * mask).sum(-1) / mask.sum(-1)
    ratio = torch.exp(seq).unsqueeze(-1).expand(3, 5)
    direct = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    aggregate(direct, mask, loss_type).backward()
    torch.testing.assert_close(logps_a.grad, logps_b.grad)


# ratios 0.5, 1.0, 1.5 for a positive (row 0) and a negative (row 1) advantage; padding ratio 100
RATIOS = torch.tensor([[0.5, 1.0, 1.5, 100.0], [0.5, 1.0, 1.5, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])


def test_clipping_both_ends_and_signs():
    logps = torch.log(RATIOS).requires_grad_()
    per_token, stats = clipped_surrogate(
        logps, torch.zeros(2, 4), ADV, MASK, epsilon_low=0.2, epsilon_high=0.3
    )
    # A=+1: -min(r, clip(r, .8, 1.3)) -> -.5, -1, -1.3 (high clip binds)
    # A=-1: -min(-r, -clip(r)) = max(r, clip(r)) -> .8 (low clip binds), 1, 1.5
    close(per_token[:, :3], [[-0.5, -1.0, -1.3], [0.8, 1.0, 1.5]])
    (per_token * MASK).sum().backward()
    # -A·r where unclipped, 0 where the clip binds; a wrong-signed advantage would flip these
    close(logps.grad[:, :3], [[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]])
    close(stats["clip_ratio/low"], 1 / 6)
    close(stats["clip_ratio/high"], 1 / 6)
    close(stats["clip_ratio/region"], 2 / 6)
    close(stats["ratio/mean"], 1.0)  # the padding ratio of 100 is ignored
    close(stats["ratio/min"], 0.5)
    close(stats["ratio/max"], 1.5)


def test_epsilon_high_defaults_to_epsilon_low():
    per_token, stats = clipped_surrogate(torch.log(RATIOS), torch.zeros(2, 4), ADV, MASK, epsilon_low=0.2)
    close(per_token[0, 2], -1.2)
    assert all(not v.requires_grad for v in stats.values())


def test_k3_zero_when_equal_positive_otherwise():
    x = torch.tensor([-1.0, -2.0])
    close(k3_kl(x, x), [0.0, 0.0])
    # logp = ln .5, ref = ln .25: exp(-ln2) + ln2 - 1 = ln2 - 0.5; swapped: 2 - ln2 - 1
    out = k3_kl(torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)]))
    close(out, [L2 - 0.5, 1.0 - L2])
    assert (out > 0).all()


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("grpo", {}, (6 / 3 + 9 / 2) / 2),  # mean of sequence means
        ("bnpo", {}, 15 / 5),  # local token mean
        ("dr_grpo", {"max_completion_length": 10}, 15 / (2 * 10)),
        ("dr_grpo", {}, 15 / (2 * 4)),  # max_completion_length defaults to T
        ("dapo", {}, 15 / 5),  # local tokens by default
        ("dapo", {"num_items_in_batch": 30}, 15 / 30),  # whole generation batch's tokens
        ("grpo", {"num_sequences_in_batch": 8}, (6 / 3 + 9 / 2) / 8),
    ],
)
def test_aggregations(loss_type: str, kwargs: dict, expected: float):
    close(aggregate(PER_TOKEN, AGG_MASK, loss_type, **kwargs), expected)  # type: ignore[arg-type]


def test_unknown_loss_type_lists_valid_ones():
    with pytest.raises(ValueError, match="grpo.*bnpo.*dr_grpo.*dapo"):
        aggregate(PER_TOKEN, AGG_MASK, "ppo")  # type: ignore[arg-type]


def test_policy_loss_combines_is_weights_kl_and_aggregation():
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    loss, metrics = policy_loss(
        logps, None, torch.tensor([2.0]), torch.ones(1, 2), ref_logps=ref, beta=0.1,
        is_weights=torch.tensor([[0.5, 1.0]]), loss_type="dapo",
    )  # fmt: skip
    # on-policy r = 1: surrogate -2 per token, IS-weighted [-1, -2]; k3 = [ln2 - 0.5, 0] unweighted
    close(loss, (-3.0 + 0.1 * (L2 - 0.5)) / 2)
    close(metrics["kl"], (L2 - 0.5) / 2)
    close(metrics["is_weight/mean"], 0.75)
    assert all(not v.requires_grad for v in metrics.values())
    loss.backward()
    # d/dlogp: -A·w + β·(1 - exp(ref - logp)), over 2 tokens
    close(logps.grad, [[(-1.0 + 0.1 * 0.5) / 2, -2.0 / 2]])


def test_policy_loss_beta_zero_skips_kl():
    _, metrics = policy_loss(
        torch.zeros(1, 2), None, torch.ones(1), torch.ones(1, 2), ref_logps=torch.ones(1, 2)
    )
    assert "kl" not in metrics


@pytest.mark.parametrize(
    ("loss_type", "global_kwargs"),
    [
        ("dapo", lambda m: {"num_items_in_batch": m.sum()}),
        ("dr_grpo", lambda m: {"num_sequences_in_batch": m.shape[0], "max_completion_length": 6}),
        ("grpo", lambda m: {"num_sequences_in_batch": m.shape[0]}),
    ],
)
def test_accumulation_equivalence(loss_type: str, global_kwargs):
    # batch 4 × accumulation 1 == batch 1 × accumulation 4 once the normaliser is global
    torch.manual_seed(0)
    old, ref = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    full_logps = (old + 0.3 * torch.randn(4, 6)).requires_grad_()  # off-policy enough to clip
    kw = {"beta": 0.04, "loss_type": loss_type, **global_kwargs(mask)}
    full, stats = policy_loss(full_logps, old, adv, mask, ref_logps=ref, **kw)
    assert stats["clip_ratio/region"] > 0  # the clip is exercised, not only the linear part
    full.backward()
    micro_logps = full_logps.detach().clone().requires_grad_()
    total = sum(
        policy_loss(micro_logps[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                    ref_logps=ref[i : i + 1], **kw)[0]
        for i in range(4)
    )  # fmt: skip
    total.backward()
    close(total.detach(), full.item())
    torch.testing.assert_close(micro_logps.grad, full_logps.grad)


def test_local_normaliser_breaks_accumulation():
    # why the global normaliser matters: bnpo (local token mean) weighs short micro-batches up
    full = aggregate(PER_TOKEN, AGG_MASK, "bnpo")
    micro = sum(aggregate(PER_TOKEN[i : i + 1], AGG_MASK[i : i + 1], "bnpo") for i in range(2)) / 2
    assert not torch.isclose(full, micro)
