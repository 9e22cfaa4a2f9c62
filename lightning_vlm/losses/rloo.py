"""RLOO's policy loss (Ahmadian et al. 2024, as TRL's RLOOTrainer): one clipped ratio per sequence.

Unlike GSPO's length-normalised ratio, RLOO treats the whole completion as one action: the ratio is
the likelihood ratio of the sequence, exp(Σ_t (logp_t - old_t)), the SUM of token log-ratios. The
KL penalty is already in the reward (``advantages.kl_penalized_rewards``), so there is no KL term.
"""

from __future__ import annotations

import torch

from lightning_vlm.losses.normalizers import capped_exp


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π(y)/π_old(y) = Σ_t mask·(logp_t - old_t), one value per sequence [N]."""
    return ((logps - old_logps) * mask.to(logps.dtype)).sum(-1)


def rloo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    num_sequences_in_batch: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_i -min(s_i·A_i, clip(s_i, 1-ε_l, 1+ε_h)·A_i) / N with s_i = exp(min(Σ_t logp - old, 20)), and
    metrics.

    ``old_logps=None`` is on-policy: s = 1 in value, and the gradient is REINFORCE's -A·Σ_t ∇logp_t.
    ``num_sequences_in_batch`` replaces the local N so gradient accumulation gives the full-batch update.
    """
    if old_logps is None:
        old_logps = logps.detach()
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    # A summed log-ratio passes exp's float32 range (~88) on long off-policy answers (capped_exp says why).
    ratio = capped_exp(sequence_log_ratio(logps, old_logps, mask))
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + eps_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)
    n = per_sequence.shape[0] if num_sequences_in_batch is None else num_sequences_in_batch
    loss = per_sequence.sum() / n
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "clip_ratio/low": (low := (r < 1.0 - epsilon_low) & (advantages < 0)).float().mean(),
            "clip_ratio/high": (high := (r > 1.0 + eps_high) & (advantages > 0)).float().mean(),
            "clip_ratio/region": (low | high).float().mean(),
            "ratio/mean": r.mean(),
            "ratio/min": r.min(),
            "ratio/max": r.max(),
        }
    return loss, stats


def mean_token_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logged ``kl``: log π_old - log π_ref per active token, averaged over tokens (TRL's RLOO and our
    GRPO log it per token; the penalty in the reward uses the per-sequence sum)."""
    mask = mask.to(old_logps.dtype)
    return ((old_logps - ref_logps) * mask).sum() / mask.sum().clamp(min=1)
