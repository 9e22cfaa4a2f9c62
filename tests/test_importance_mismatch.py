"""The importance-sampling correction on a real sampler/trainer mismatch, without vLLM.

The sampler is HF ``generate`` on a drifted copy of the policy (every weight moved by N(0, 0.02²)
noise), flagged as not the policy, with its own per-token log-probs: the trainer's log-probs of those
completions differ from the sampler's by tens of percent per token, as a stale or lower-precision
engine's do (the vLLM tests see ratios ≈ 1). Each of TRL's four modes must cap or mask exactly the
tokens (or sequences) whose ratio π_trainer/π_sampler is outside [clip_min, clip_max], and the loss must weigh each
token's surrogate by the resulting weight, as computed here by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hand_helpers import assert_same_update, completion_logps, group_advantages_by_hand, hand_update
from online_helpers import fit_steps, sgd, token_reward_fn

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.generation.base import OwnWeightsGenerator
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.methods.grpo import GRPO
from lightning_vlm.models.vlm import VLM

CAP, FLOOR = 1.2, 0.8  # vllm_importance_sampling_clip_max and _clip_min
G = 4


class DriftedSampler(OwnWeightsGenerator):
    """HF generate on a drifted copy of the policy: not the policy, so its log-probs drive the correction
    (unseeded itself: the loop's seeded torch RNG drives its draws)."""

    is_policy = False

    def __init__(self, path: str, noise: float = 0.02) -> None:
        vlm = VLM(path)
        rng = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in vlm.parameters():
                p.add_(torch.randn(p.shape, generator=rng) * noise)
        self.hf = HFGenerator(vlm)
        self.seen = []

    def generate(self, rows, num_generations, sampling):
        rollouts = self.hf.generate(rows, num_generations, sampling)
        self.seen.append(rollouts)
        return rollouts


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_follow_the_mode_on_a_real_mismatch(tiny_path, mode):
    path = tiny_path("qwen2_5_vl")
    rows = synthetic_rows("prompt", 2, seed=3)
    vlm = VLM(path)
    before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
    module = GRPO(vlm, optimizer=sgd(), max_grad_norm=None, reward_funcs=[token_reward_fn], num_generations=G,
                  max_completion_length=6, vllm_importance_sampling_mode=mode,
                  vllm_importance_sampling_clip_max=CAP, vllm_importance_sampling_clip_min=FLOOR)  # fmt: skip
    sampler = DriftedSampler(path)
    module.generator = sampler
    metrics = {k: v.item() for k, v in fit_steps(module, rows).callback_metrics.items()}
    update = {n: p.detach() - before[n] for n, p in vlm.named_parameters()}

    # By hand: the trainer's log-probs of the sampled completions (initial weights) against the sampler's.
    (rollouts,) = sampler.seen
    with torch.no_grad():
        trainer_logps, _, mask = completion_logps(VLM(path), rollouts)
    sampler_logps = torch.zeros_like(trainer_logps)
    for i, lp in enumerate(rollouts.logprobs):
        sampler_logps[i, : len(lp)] = torch.tensor(lp)
    log_ratio = (trainer_logps - sampler_logps) * mask
    level, kind = mode.split("_")
    if level == "token":
        log_rho, units = log_ratio, mask.bool()
    else:  # the whole completion's likelihood ratio: the product of its token ratios
        log_rho, units = log_ratio.sum(-1, keepdim=True), torch.ones(len(mask), 1, dtype=torch.bool)
    over = (log_rho > math.log(CAP)) | (log_rho < math.log(FLOOR))
    rho = log_rho.exp()
    weight = rho.clamp(FLOOR, CAP) if kind == "truncate" else torch.where(over, torch.zeros_like(rho), rho)
    weight = weight.expand_as(mask) * mask

    # A real mismatch: the drifted sampler is tens of percent off per token, and some (not all) are capped.
    assert metrics["train/sampler_logp_diff/max"] > 0.3
    capped = over[units].float().mean().item()
    assert 0.0 < capped < 1.0
    # both bounds act
    assert (log_rho < math.log(FLOOR))[units].any() and (log_rho > math.log(CAP))[units].any()
    assert metrics["train/is_ratio/capped_frac"] == pytest.approx(capped)
    assert metrics["train/is_ratio/max"] == pytest.approx(rho[units].max().item(), rel=1e-4)
    assert metrics["train/is_ratio/mean"] == pytest.approx(rho[units].mean().item(), rel=1e-4)
    assert metrics["train/is_weight/mean"] == pytest.approx(
        ((weight * mask).sum() / mask.sum()).item(), rel=1e-4
    )

    # The loss (dapo, on-policy ratio 1): each token's surrogate -A_i weighted by its IS weight.
    adv = group_advantages_by_hand(token_reward_fn(None, rollouts.completion_ids), G)

    def loss(logps, entropy, m):
        return (-adv[:, None] * torch.exp(logps - logps.detach()) * weight * m).sum() / m.sum()

    expected, value = hand_update(path, rollouts, loss)
    assert metrics["train/loss"] == pytest.approx(value, abs=1e-6)
    assert_same_update(update, expected)


def test_vespo_refuses_a_sequence_level_correction_before_the_first_generation(tiny_path, caplog):
    path = tiny_path("qwen2_5_vl")
    kwargs = {"optimizer": sgd(), "reward_funcs": [token_reward_fn], "num_generations": G, "max_completion_length": 6,
              "loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"}  # fmt: skip
    module = GRPO(VLM(path), **kwargs)
    sampler = DriftedSampler(path)
    module.generator = sampler
    with pytest.raises(ValueError, match="vespo folds the rollout IS ratios.*token_truncate"):
        fit_steps(module, synthetic_rows("prompt", 2, seed=3))
    assert sampler.seen == []  # refused at fit start, not after a generation
    # Sampling from the policy itself (HF generate) needs no correction: the same settings train.
    fit_steps(GRPO(VLM(path), **kwargs), synthetic_rows("prompt", 2, seed=3))
    # The pairings TRL warns about are named when the module is built.
    with caplog.at_level("WARNING", logger="lightning_vlm.methods.grpo"):
        GRPO(VLM(path), **{**kwargs, "importance_sampling_level": "sequence"})
    assert "vespo builds its sequence weight from token ratios" in caplog.text
