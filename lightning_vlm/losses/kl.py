"""The KL terms of the policy losses: Schulman's k3 estimator and the ratio that removes its bias off-policy.

Inputs are per-token log-probs [N, T] with a 0/1 completion mask, as in ``policy.py``.
"""

from __future__ import annotations

from typing import Literal

import torch

from lightning_vlm.losses.normalizers import MAX_LOG_RATIO, capped_exp

# Where an importance ratio lives: per token (PPO/GRPO) or per sequence (GSPO); policy.py uses it too.
Level = Literal["token", "sequence"]


def kl_correction_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: Level = "token"
) -> torch.Tensor:
    """The ratio π/π_old that ``use_bias_correction_kl`` multiplies the k3 KL by, [N, T] or [N, 1].

    Token level: r_it, as in the surrogate. Sequence level: GSPO's s_i as one differentiable value per
    sequence (TRL's form), not the GSPO-token form of ``importance_ratio``: the two have the same value,
    but the KL varies along a sequence, so only this one gives the gradient of s_i·kl_t, which is
    s_i·∇kl_t + kl_t·∇s_i with ∇s_i = s_i·(1/|y_i|) Σ_t ∇logp_it. DeepSeek-V3.2 defines the correction
    with each token's own ratio only; at sequence level we follow TRL (the two differ wherever the
    token ratios of a sequence differ).
    """
    if level == "token":
        return capped_exp(logps - old_logps)
    m = mask.to(logps.dtype)
    return capped_exp(
        ((logps - old_logps) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    )


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per token: exp(ref - logp) - (ref - logp) - 1 ≥ 0.

    Unbiased under samples from π, always non-negative, zero iff logp == ref (GRPO eq. 4). ref - logp is
    capped at ``MAX_LOG_RATIO`` (a token the policy gives e^-90 less than the reference overflowed to
    inf, in the loss and its gradient); past the cap the gradient is 0.
    """
    delta = torch.clamp(ref_logps - logps, max=MAX_LOG_RATIO)
    return torch.exp(delta) - delta - 1.0
