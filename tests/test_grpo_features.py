"""GRPO's settings through a real training step, each against its formula computed by hand:
``loss_type=bnpo``, ``scale_rewards``, ``top_entropy_quantile`` and ``mask_truncated_completions``.

Every test runs one optimizer step (SGD lr 1, no clipping) on fixed rollouts of chosen lengths and
compares the weight update and the logged loss with those of the loss written out from the feature's
definition (TRL's), on the same model. On-policy the ratio is 1 in value, so a token's surrogate is
-A_i and the loss value follows from the advantages and the masks alone.
"""

from __future__ import annotations

import copy
import logging
from functools import partial

import pytest
import torch
from hand_helpers import (
    assert_same_update,
    completion_logps,
    differs,
    group_advantages_by_hand,
    hand_update,
    shaped_rollouts,
    step_update,
    table_reward,
)

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.losses.policy import policy_loss
from lightning_vlm.methods.grpo import GRPO, linear_quantile
from lightning_vlm.models.vlm import VLM

G = 4
LENGTHS = [1, 2, 3, 6, 5, 4, 2, 6]  # unequal, so token means and sequence means differ
# Two groups with different spreads: group, batch and no scaling give different advantages.
REWARDS = [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 4.0]


@pytest.fixture(scope="module")
def setup(tiny_path):
    path = tiny_path("qwen2_5_vl")
    rows = synthetic_rows("prompt", 2, seed=3)
    finished = [True, False, True, False, False, True, True, False]
    rollouts = shaped_rollouts(VLM(path), rows, G, LENGTHS, finished)
    return path, rows, rollouts


def ratio(logps):
    """π/π_old on-policy: 1 in value, ∇logp in gradient."""
    return torch.exp(logps - logps.detach())


def dapo_loss(adv, keep=None):
    """Σ -A·r over kept tokens / every completion token of the step (TRL's dapo)."""

    def loss(logps, entropy, mask):
        kept = mask if keep is None else mask * keep(entropy, mask)
        return (-adv[:, None] * ratio(logps) * kept).sum() / mask.sum()

    return loss


def test_bnpo_normalises_each_micro_batch_by_its_own_tokens(setup):
    path, rows, rollouts = setup
    adv = group_advantages_by_hand(REWARDS, G)
    micro = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]

    def bnpo(logps, entropy, mask):
        # TRL: each micro-batch's token mean, over gradient accumulation of the step's 4 micro-batches.
        per_token = -adv[:, None] * ratio(logps) * mask
        return sum(per_token[s].sum() / mask[s].sum() * 2 / 8 for s in micro)

    expected, value = hand_update(path, rollouts, bnpo)
    update, metrics = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                  loss_type="bnpo", micro_batch_size=2)  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/loss"] == pytest.approx(value, abs=1e-6)
    # by hand, from the lengths alone: Σ_micro (2/8)·(-Σ A_i L_i) / Σ L_i
    lengths = torch.tensor(LENGTHS, dtype=torch.float)
    by_lengths = sum(-(adv[s] * lengths[s]).sum() / lengths[s].sum() / 4 for s in micro)
    assert value == pytest.approx(by_lengths.item(), abs=1e-6)
    # and it is not the step's token mean (dapo), which the same rollouts give as:
    dapo_value = -(adv * lengths).sum() / lengths.sum()
    assert abs(value - dapo_value.item()) > 0.05


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_sets_the_advantages_and_the_update(setup, scale):
    path, rows, rollouts = setup
    adv = group_advantages_by_hand(REWARDS, G, scale)
    expected, value = hand_update(path, rollouts, dapo_loss(adv))
    update, metrics = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                  scale_rewards=scale)  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/advantages/abs_mean"] == pytest.approx(adv.abs().mean().item(), rel=1e-5)
    assert metrics["train/advantages/std"] == pytest.approx(adv.std().item(), rel=1e-5)
    assert metrics["train/loss"] == pytest.approx(value, abs=1e-6)
    lengths = torch.tensor(LENGTHS, dtype=torch.float)
    assert value == pytest.approx((-(adv * lengths).sum() / lengths.sum()).item(), abs=1e-6)
    # the three settings really differ on these rollouts
    for other in {"group", "batch", "none"} - {scale}:
        assert not torch.allclose(group_advantages_by_hand(REWARDS, G, other), adv, atol=1e-3)


# 0.0: TRL's "only the highest-entropy token" (it was refused here)
@pytest.mark.parametrize(("loss_type", "quantile"), [("dapo", 0.4), ("grpo", 0.4), ("dapo", 0.0)])
def test_top_entropy_quantile_trains_only_the_highest_entropy_tokens(setup, loss_type, quantile):
    path, rows, rollouts = setup
    adv = group_advantages_by_hand(REWARDS, G)

    def top(entropy, mask):
        threshold = torch.quantile(entropy[mask.bool()], 1 - quantile)
        return (entropy >= threshold).float() * mask

    def loss(logps, entropy, mask):
        # TRL: the entropy mask zeroes the other tokens' surrogate; the normalisers stay the completion
        # tokens (dapo: of the step, grpo: of each sequence).
        per_token = -adv[:, None] * ratio(logps) * top(entropy, mask)
        if loss_type == "dapo":
            return per_token.sum() / mask.sum()
        return (per_token.sum(-1) / mask.sum(-1)).mean()

    expected, value = hand_update(path, rollouts, loss)
    update, metrics = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                  top_entropy_quantile=quantile, loss_type=loss_type)  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/loss"] == pytest.approx(value, abs=1e-6)
    # a real selection: some but not all tokens, and an update other than training on every token
    _, entropy, mask = _logps(path, rollouts)
    kept = top(entropy, mask).sum()
    assert kept == 1 if quantile == 0.0 else 0.3 < kept / mask.sum() < 0.5
    everything, _ = hand_update(path, rollouts, dapo_loss(adv) if loss_type == "dapo" else _grpo_loss(adv))
    assert differs(expected, everything)


def test_the_adaptive_entropy_controller_watches_every_completion_token(setup):
    # Skywork-OR1's controller steers the entropy of the whole response; TRL measures only the tokens
    # top_entropy_quantile keeps (the README says we differ), whose mean sits above a target for all.
    path, rows, rollouts = setup
    _, entropy, mask = _logps(path, rollouts)
    every = float((entropy * mask).sum() / mask.sum())
    kept = entropy * mask >= torch.quantile(entropy[mask.bool()], 0.6)
    assert (
        float(entropy[kept].mean()) > every + 1e-4
    )  # TRL's reading: another number (the tiny model is near uniform)
    modules: list = []
    step_update(path, GRPO, rows, rollouts, modules, reward_funcs=[table_reward(rollouts, REWARDS)],
                top_entropy_quantile=0.4, use_adaptive_entropy=True)  # fmt: skip
    assert modules[0].entropy_control.last_entropy == pytest.approx(every, abs=2e-5)


def test_the_entropy_threshold_is_torch_quantile_for_any_number_of_tokens():
    # torch.quantile refuses inputs over 2**24 elements ("input tensor is too large"): a micro-batch's
    # tokens gathered from many ranks can hold that many.
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.2, 0.5, 0.6, 0.99, 1.0):
        torch.testing.assert_close(linear_quantile(x, q), torch.quantile(x, q))
        torch.testing.assert_close(linear_quantile(x[:1], q), x[0])
    big = torch.arange(2**24 + 2, dtype=torch.float64).flip(0)
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(big, 0.5)
    assert linear_quantile(big, 0.5).item() == (2**24 + 1) / 2


def test_mask_truncated_completions_drops_truncated_ones_from_the_loss(setup):
    path, rows, rollouts = setup
    # Advantages come from every completion's reward (truncated ones still count in the group, as TRL).
    adv = group_advantages_by_hand(REWARDS, G)
    finished = torch.tensor([not t for t in rollouts.truncated], dtype=torch.float)

    def loss(logps, entropy, mask):
        kept = mask * finished[:, None]  # dapo's normaliser: the tokens left in the loss
        return (-adv[:, None] * ratio(logps) * kept).sum() / kept.sum()

    expected, value = hand_update(path, rollouts, loss)
    update, metrics = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                  mask_truncated_completions=True)  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/loss"] == pytest.approx(value, abs=1e-6)
    assert metrics["train/completions/clipped_ratio"] == pytest.approx(0.5)
    # masking matters here, and without it every completion trains
    everything, _ = hand_update(path, rollouts, dapo_loss(adv))
    assert differs(expected, everything)
    unmasked, _ = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)])
    assert_same_update(unmasked, everything)
    # one completion per micro-batch: the truncated ones' micro-batches have nothing left in the loss, and
    # still backpropagate (zero gradients) instead of failing; the step is the same
    micro, micro_metrics = step_update(path, GRPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                       mask_truncated_completions=True, micro_batch_size=1)  # fmt: skip
    assert_same_update(micro, expected)
    # and its stats describe the completions left: the masked ones' micro-batches added a 0 at full
    # weight (ratio/mean 0.5 on policy, where ratio/min was 1; the entropy halved)
    assert micro_metrics["train/ratio/mean"] == pytest.approx(1.0) == metrics["train/ratio/mean"]
    assert micro_metrics["train/entropy"] == pytest.approx(metrics["train/entropy"], rel=1e-4)


def test_entropy_mask_zeroes_the_surrogate_only_not_the_kl_or_the_normaliser():
    # TRL: per_token_loss * entropy_mask, then + β·KL, aggregated over the completion mask.
    logps = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    ref = torch.tensor([[-1.3, -1.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    top = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    loss, _ = policy_loss(logps, None, torch.tensor([2.0]), mask, ref_logps=ref, beta=0.1, entropy_mask=top,
                          loss_type="grpo")  # fmt: skip
    k3 = (ref - logps).exp() - (ref - logps) - 1
    expected = ((-2.0 * top + 0.1 * k3) * mask).sum() / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def _grpo_loss(adv):
    def loss(logps, entropy, mask):
        return ((-adv[:, None] * ratio(logps) * mask).sum(-1) / mask.sum(-1)).mean()

    return loss


def _logps(path, rollouts):
    with torch.no_grad():
        return completion_logps(VLM(path), rollouts)


def test_the_off_policy_mask_measures_the_policys_own_sampling_from_the_old_policy(setup):
    # HF generate is the policy: its scores are reshaped by top_p / top_k, so log(π_sampler/π) > 0 on
    # every token and the mask dropped every negative sample of an on-policy step. TRL has no sampler
    # log-probs there and measures from the old policy (nothing is masked on-policy), as now.
    path, rows, rollouts = setup
    reshaped = copy.copy(rollouts)
    reshaped.logprobs = [[0.0] * len(ids) for ids in rollouts.completion_ids]  # kept mass 1 per token
    kw = {"reward_funcs": [table_reward(rollouts, REWARDS)], "vllm_importance_sampling_correction": False}
    plain, _ = step_update(path, GRPO, rows, rollouts, **kw)
    masked, metrics = step_update(path, GRPO, rows, reshaped, off_policy_mask_threshold=0.1, **kw)
    assert_same_update(masked, plain)
    assert metrics["train/off_policy_mask/masked_frac"] == 0.0
    # A sampler that is not the policy (vLLM) is measured from its own log-probs: negatives are dropped.
    reshaped.extras = {**reshaped.extras, "is_policy": False}
    other, metrics = step_update(path, GRPO, rows, reshaped, off_policy_mask_threshold=0.1, **kw)
    assert differs(other, plain)
    negatives = sum(a < 0 for a in group_advantages_by_hand(REWARDS, G).tolist())
    assert metrics["train/off_policy_mask/masked_frac"] == pytest.approx(negatives / len(REWARDS))


def test_settings_the_loss_type_never_reads_are_named_and_delta_without_a_clip_is_refused(setup, caplog):
    # TRL ignores them without a word: a sweep over sapo's temperatures under dapo compared identical runs.
    path, _, _ = setup
    vlm = VLM(path)
    build = partial(GRPO, vlm, optimizer=partial(torch.optim.SGD, lr=1.0), steps_per_generation=2)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        build(loss_type="sapo", sapo_temperature_pos=2.0, epsilon=0.3, entropy_target=0.5)
    (said,) = [r.getMessage() for r in caplog.records if "do nothing here" in r.getMessage()]
    assert "method.epsilon=0.3 (read by grpo / bnpo / dr_grpo / dapo / luspo)" in said
    assert "method.entropy_target=0.5 (read by use_adaptive_entropy)" in said
    assert "sapo_temperature" not in said  # sapo reads them
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        build(loss_type="cispo", epsilon_high=5.0)  # cispo's cap
        build(loss_type="vespo", vespo_k_pos=3.0, use_adaptive_entropy=True, entropy_target=0.5)
    assert "do nothing here" not in caplog.text
    with pytest.raises(ValueError, match=r"delta caps the clipped surrogate's ratio, which loss_type=sapo"):
        build(loss_type="sapo", delta=2.0)


def test_ratio_settings_are_named_when_one_step_per_generation_keeps_every_ratio_at_1(setup, caplog):
    # method=dapo's clip-higher (epsilon_high 0.28) did nothing: one optimizer step per generation, so the
    # policy never moved from the one that sampled and every ratio was 1.
    path, _, _ = setup
    build = partial(GRPO, VLM(path), optimizer=partial(torch.optim.SGD, lr=1.0))
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        build(epsilon_high=0.28, delta=2.0)
        build(loss_type="cispo", epsilon_high=0.5)  # a cap below 1 acts at r = 1: said nowhere
    (said,) = [r.getMessage() for r in caplog.records if "do nothing here" in r.getMessage()]
    assert "method.epsilon_high=0.28 (every ratio is 1 with one optimizer step per generation" in said
    assert "method.delta=2.0 (every ratio is 1" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        build(epsilon_high=0.28, steps_per_generation=2)
        build(epsilon_high=0.28, num_iterations=2)
    assert "do nothing here" not in caplog.text
