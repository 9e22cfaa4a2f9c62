"""TRL's newer GRPO terms against hand-computed values: cispo, sapo, luspo, vespo, delta, the
off-policy mask, the bias-corrected KL, the entropy bonus and its adaptive controller, and GDPO."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.advantages import decoupled_advantages, group_advantages
from lightning_vlm.losses.policy import aggregate, clipped_surrogate, policy_loss
from lightning_vlm.losses.policy_variants import (
    AdaptiveEntropy,
    VespoShape,
    cispo_per_token,
    off_policy_mask,
    sapo_per_token,
    vespo_weights,
)

L2 = math.log(2)


def close(actual: torch.Tensor | float, expected) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def test_cispo_caps_the_detached_weight_and_keeps_every_token_gradient():
    # ratios 2 and 1 (log 0.5 vs log 0.25; equal), A = 1, eps_max = 1.5 -> weights 1.5 and 1.
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    ratio = torch.tensor([[2.0, 1.0]])
    per_token = cispo_per_token(logps, ratio, torch.tensor([1.0]), 1.5)
    close(per_token, [[1.5 * L2, 2 * L2]])  # -w·A·logp
    per_token.sum().backward()
    close(logps.grad, [[-1.5, -1.0]])  # the clipped token still gets -w·A, not 0 (PPO would zero it)


def test_cispo_through_policy_loss_is_dapo_aggregated_with_trls_metric():
    logps = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    old = torch.tensor([[math.log(0.25), math.log(0.25), 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logps, old, torch.tensor([1.0]), mask, loss_type="cispo", epsilon_high=1.5)
    close(loss, (1.5 * L2 + 2 * L2) / 2)  # Σ l·m / active tokens
    close(stats["cispo_clip_ratio"], 0.5)  # one of two tokens above eps_max with A > 0
    with pytest.raises(ValueError, match="cispo caps the IS weight at epsilon_high"):
        policy_loss(logps, old, torch.tensor([1.0]), mask, loss_type="cispo")


def test_sapo_gate_values_and_its_gradient_is_plain_pg_on_policy():
    ratio = torch.tensor([[1.0, 2.0], [1.0, 1.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    per_token = sapo_per_token(ratio, adv)
    sig1 = 1 / (1 + math.exp(-1.0))
    # A > 0, tau 1: -σ(0)·4 = -2 and -σ(1)·4; A < 0, tau 1.05: +σ(0)·4/1.05
    close(per_token, [[-2.0, -4 * sig1], [4 * 0.5 / 1.05, 4 * 0.5 / 1.05]])
    per_token.sum().backward()
    # d/dr = -4σ'(τ(r-1))·A = -A at r = 1 (σ' = 1/4)
    close(ratio.grad[:, 0], [-1.0, 1.0])
    close(ratio.grad[0, 1], -4 * sig1 * (1 - sig1))


def test_luspo_weighs_each_sequence_by_its_length():
    per_token = torch.tensor([[0.5, 0.5, 9.0], [2.0, 2.0, 2.0]])  # a sequence-level (GSPO) loss per row
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    close(aggregate(per_token, mask, "luspo"), (2 * 0.5 + 3 * 2.0) / 2)
    close(aggregate(per_token, mask, "luspo", num_sequences_in_batch=4), (2 * 0.5 + 3 * 2.0) / 4)
    close(aggregate(per_token, mask, "sapo"), aggregate(per_token, mask, "grpo"))
    close(aggregate(per_token, mask, "vespo"), aggregate(per_token, mask, "dapo"))


def test_vespo_weight_is_one_on_policy_and_follows_its_shape():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0]])
    log_ratio = torch.tensor([[0.0, 0.0, 5.0], [L2, 0.0, 5.0], [L2, 0.0, 5.0]])  # padding ignored
    phi = vespo_weights(log_ratio, mask, torch.tensor([1.0, 1.0, -1.0]))
    # w = 1 -> 1; w = 2, A > 0 (k 2, λ 3): 4·e^-3; w = 2, A < 0 (k 3, λ 2): 8·e^-2
    close(phi, [[1.0], [4 * math.exp(-3)], [8 * math.exp(-2)]])
    # the rollout IS ratio folds into w: token ratios 2·0.5 = 1 -> φ = 1
    folded = vespo_weights(log_ratio[1:2], mask[1:2], torch.tensor([1.0]), VespoShape(),
                           torch.tensor([[-L2, 0.0, 0.0]]))  # fmt: skip
    close(folded, [[1.0]])


def test_vespo_through_policy_loss_is_reinforce_with_the_weight():
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25)]])  # w = 2
    loss, stats = policy_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 2), loss_type="vespo")
    phi = 4 * math.exp(-3)
    close(loss, -phi * (math.log(0.5) + math.log(0.25)) / 2)
    close(stats["vespo/phi_seq_mean"], phi)
    loss.backward()
    close(logps.grad, [[-phi / 2, -phi / 2]])


def test_delta_caps_the_unclipped_ratio_for_negative_advantages():
    ratio = torch.tensor([[0.5, 3.0]])
    logps, old, mask = ratio.log(), torch.zeros(1, 2), torch.ones(1, 2)
    plain, _ = clipped_surrogate(logps, old, torch.tensor([-1.0]), mask, 0.2, 0.2)
    capped, _ = clipped_surrogate(logps, old, torch.tensor([-1.0]), mask, 0.2, 0.2, delta=2.0)
    # -min(r·A, clip(r)·A) with A = -1: max(r, clip(r)) -> 0.8, 3.0; with δ = 2: 0.8, 2.0
    close(plain, [[0.8, 3.0]])
    close(capped, [[0.8, 2.0]])
    positive, _ = clipped_surrogate(logps, old, torch.tensor([1.0]), mask, 0.2, 0.2, delta=2.0)
    close(positive, [[-0.5, -1.2]])  # A > 0: unchanged by δ > 1 + ε


def test_off_policy_mask_drops_only_negative_far_off_sequences():
    logps = torch.zeros(3, 2)
    sampler = torch.tensor([[0.6, 0.6], [2.0, 2.0], [0.3, 0.3]])  # mean log(π_sampler/π) 0.6, 2.0, 0.3
    mask = torch.ones(3, 2)
    keep = off_policy_mask(logps, sampler, torch.tensor([-1.0, 1.0, -1.0]), mask, threshold=0.5)
    close(keep, [[0.0], [1.0], [1.0]])
    loss, stats = policy_loss(logps, None, torch.tensor([-1.0, 1.0, -1.0]), mask, sampler_logps=sampler,
                              off_policy_mask_threshold=0.5)  # fmt: skip
    close(loss, (0 + 2 * -1.0 + 2 * 1.0) / 6)  # the dropped tokens still count in the normaliser
    close(stats["off_policy_mask/masked_frac"], 1 / 3)
    # A sequence without active tokens (a masked truncation) is no sample: it was counted as kept (1/4).
    padded = torch.cat([mask, torch.zeros(1, 2)])
    _, stats = policy_loss(torch.zeros(4, 2), None, torch.tensor([-1.0, 1.0, -1.0, -1.0]), padded,
                           sampler_logps=torch.cat([sampler, torch.zeros(1, 2)]),
                           off_policy_mask_threshold=0.5)  # fmt: skip
    close(stats["off_policy_mask/masked_frac"], 1 / 3)


def test_bias_corrected_kl_multiplies_k3_by_the_ratio():
    logps = torch.tensor([[math.log(0.5)]])
    old = torch.tensor([[math.log(0.25)]])  # ratio 2
    ref = torch.tensor([[math.log(0.25)]])
    k3 = 0.5 + L2 - 1  # exp(ref - logp) - (ref - logp) - 1
    kw = {"ref_logps": ref, "beta": 1.0, "epsilon_low": 10.0}
    _, plain = policy_loss(logps, old, torch.tensor([0.0]), torch.ones(1, 1), **kw)
    _, corrected = policy_loss(
        logps, old, torch.tensor([0.0]), torch.ones(1, 1), use_bias_correction_kl=True, **kw
    )
    close(plain["kl"], k3)
    close(corrected["kl"], 2 * k3)


def test_bias_corrected_kl_at_sequence_level_has_the_gradient_of_s_times_kl():
    # One sequence of two tokens: log ratios ln 2 and 0, so s = exp(ln 2 / 2) = √2; KL ln2 - 1/2 and 0.
    logps = torch.full((1, 2), math.log(0.5), requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    kl1, s = L2 - 0.5, math.sqrt(2)
    loss, _ = policy_loss(logps, old, torch.tensor([0.0]), torch.ones(1, 2), ref_logps=ref, beta=1.0,
                          level="sequence", use_bias_correction_kl=True)  # fmt: skip
    close(loss, s * kl1 / 2)  # dapo: (s·kl_1 + s·kl_2) / 2 tokens
    loss.backward()
    # ∂/∂logp_t of Σ_t s·kl_t / 2 = (s·∂kl_t/∂logp_t + (kl_1 + kl_2)·s/2) / 2, with ∂kl_t/∂logp_t =
    # 1 - exp(ref_t - logp_t) = 1/2 and 0. The second token's KL is 0, but s depends on it (TRL's form):
    # the GSPO-token form would give it no gradient at all.
    close(logps.grad, [[(s * 0.5 + kl1 * s / 2) / 2, (kl1 * s / 2) / 2]])


def test_sequence_level_clip_stats_count_each_sequence_once():
    # Sequence 0 (3 tokens) has ratio 2 on every token, sequence 1 (1 token) ratio 1; both A > 0.
    logps = torch.tensor([[L2, L2, L2], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, stats = clipped_surrogate(
        logps, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, 0.2, level="sequence"
    )
    close(stats["clip_ratio/high"], 1 / 2)  # a token mean would say 3/4
    close(stats["ratio/mean"], (2.0 + 1.0) / 2)  # a token mean would say 7/4
    _, tokens = clipped_surrogate(logps, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, 0.2)
    close(tokens["clip_ratio/high"], 3 / 4)  # token level: every token counts
    _, cispo = policy_loss(logps, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, loss_type="cispo",
                           epsilon_high=1.5, level="sequence")  # fmt: skip
    close(cispo["cispo_clip_ratio"], 1 / 2)


def test_entropy_bonus_with_an_entropy_mask_sums_the_trained_tokens_over_all_tokens():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    loss, _ = policy_loss(torch.zeros(1, 4), None, torch.tensor([0.0]), torch.ones(1, 4), entropy=entropy,
                          entropy_coef=0.1, entropy_mask=torch.tensor([[0.0, 0.0, 1.0, 1.0]]))  # fmt: skip
    close(loss, -0.1 * (3.0 + 4.0) / 4)  # TRL's dapo normaliser: every completion token of the step


def test_entropy_bonus_is_subtracted_per_trained_token_with_gradient():
    logps = torch.zeros(1, 3)
    entropy = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logps, None, torch.tensor([0.0]), mask, entropy=entropy, entropy_coef=0.1)
    close(loss, -0.1 * 3.0 / 2)  # policy term 0 (A = 0), bonus 0.1 · mean(1, 2)
    close(stats["policy_loss"], 0.0)
    loss.backward()
    close(entropy.grad, [[-0.05, -0.05, 0.0]])


def test_adaptive_entropy_follows_skywork_and_trls_rule():
    ctrl = AdaptiveEntropy(coef=0.0, target=0.2, delta=0.005, coef_min=0.0, coef_max=0.008)
    assert ctrl.applied == 0.0  # nothing measured yet
    ctrl.update(0.1)  # below target: more bonus, applied
    assert ctrl.coef == pytest.approx(0.005) and ctrl.applied == pytest.approx(0.005)
    ctrl.update(0.15)
    assert ctrl.coef == pytest.approx(0.008)  # capped at coef_max
    ctrl.update(0.5)  # above target: less, and none applied
    assert ctrl.coef == pytest.approx(0.003) and ctrl.applied == 0.0
    state = ctrl.state_dict()
    again = AdaptiveEntropy(coef=0.0, coef_max=0.008)
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(ValueError, match="must lie in"):
        AdaptiveEntropy(coef=2.0)


def test_gdpo_normalises_each_reward_in_its_group_then_the_sum_over_the_batch():
    # one group of 2; reward 1 differs, reward 2 ties (its group advantage is 0)
    per_function = torch.tensor([[1.0, 0.5], [0.0, 0.5]], dtype=torch.float64)
    weights = torch.tensor([1.0, 1.0])
    a1 = 0.5 / (math.sqrt(0.5) + 1e-4)  # (1 - 0.5) / (std_g + eps)
    s_std = math.sqrt(2 * a1**2)  # unbiased std of (a1, -a1)
    expected = [a1 / (s_std + 1e-4), -a1 / (s_std + 1e-4)]
    close(decoupled_advantages(per_function, weights, 2).float(), expected)
    # sum_then_normalize would give the summed reward's group advantage instead
    summed = group_advantages(per_function.sum(1), 2)
    assert not torch.allclose(summed, decoupled_advantages(per_function, weights, 2))


def test_gdpo_lets_a_small_reward_count_as_much_as_a_large_one():
    # reward 1 spans 0..100, reward 2 is 0/1; in group 1 they disagree, in group 2 only reward 2 varies
    per_function = torch.tensor([[100.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    adv = decoupled_advantages(per_function, torch.ones(2), 2)
    assert abs(adv[0]) < 1e-2 and abs(adv[1]) < 1e-2  # they cancel: each counts once, whatever its scale
    assert adv[3] > 0.7 > -0.7 > adv[2]
    summed = group_advantages(per_function.sum(1), 2)
    assert summed[0] > 0.7  # summed first, the large reward alone decides group 1


def test_gdpo_missing_rewards_give_zero_advantage_and_stay_out_of_the_statistics():
    nan = float("nan")
    per_function = torch.tensor([[1.0, nan], [0.0, nan], [nan, nan], [nan, nan]])
    adv = decoupled_advantages(per_function, torch.ones(2), 2)
    assert adv[2] == 0 and adv[3] == 0 and adv[0] > 0 > adv[1]
    with pytest.raises(ValueError, match="F = 3 weights"):
        decoupled_advantages(per_function, torch.ones(3), 2)


def test_level_advice_names_the_pairings_trl_warns_about():
    from lightning_vlm.methods.grpo import level_advice

    assert level_advice("grpo", "sequence") == [] and level_advice("dapo", "token") == []
    assert level_advice("luspo", "sequence") == [] and level_advice("vespo", "token") == []
    assert "luspo is defined at importance_sampling_level=sequence" in level_advice("luspo", "token")[0]
    assert "vespo builds its sequence weight" in level_advice("vespo", "sequence")[0]
    for loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        (advice,) = level_advice(loss_type, "sequence")
        assert f"loss_type={loss_type} sums per-token terms" in advice
