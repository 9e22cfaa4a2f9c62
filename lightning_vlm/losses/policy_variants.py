"""The newer per-token policy losses and loss terms of TRL's GRPO, as pure functions.

Shapes as in ``losses.policy``: log-probs, ratios and masks [N, T], advantages [N] or [N, 1]. Each
function names its paper; where TRL's value differs from the paper (or TRL has a trap) the
docstring says which one we follow. ``policy.policy_loss`` puts them together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _col(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def cispo_per_token(
    logps: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, epsilon_max: float
) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): -sg(min(r, ε_max))·A·logπ per token.

    The IS weight is clipped and detached, never the token's gradient: every token keeps a REINFORCE
    gradient, scaled by at most ε_max. As TRL, ε_max is an absolute cap (``epsilon_high``; ScaleRL,
    arXiv 2510.13786, uses 5.0) with no lower bound (MiniMax tunes only the upper one). TRL silently
    falls back to ``epsilon`` (0.2) when ``epsilon_high`` is unset, which caps every ratio near 1 at
    0.2; our GRPO refuses cispo without ``epsilon_high``.
    """
    weight = torch.clamp(ratio.detach(), max=epsilon_max)
    return -weight * _col(advantages) * logps


def sapo_per_token(
    ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> torch.Tensor:
    """SAPO (Gao et al. 2025, arXiv 2511.20347, eq. 6): -σ(τ(r - 1))·(4/τ)·A per token.

    A smooth gate instead of a hard clip: the gradient weight 4σ(1-σ)·r is 1 at r = 1 (plain policy
    gradient on-policy) and decays smoothly as r leaves 1, faster for negative advantages
    (τ_neg > τ_pos; τ = τ_neg for A ≤ 0, as TRL). Nothing is detached.
    """
    adv = _col(advantages)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


@dataclass(frozen=True)
class VespoShape:
    """VESPO's weight shape φ(w) = w^k·e^{λ(1-w)} per advantage sign (TRL's ``vespo_k_pos`` etc.)."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0


VESPO_DEFAULT = VespoShape()  # the authors' and TRL's defaults


def vespo_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    shape: VespoShape = VESPO_DEFAULT,
    log_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO (Shen et al. 2026, arXiv 2602.10693): the detached sequence weight φ(w_i) [N, 1].

    w_i = Π_t π/π_old over the sequence (a sum of token log-ratios, not GSPO's mean), times the
    rollout-correction ratios when given (``log_is_weights``, token level: they are folded into w
    rather than multiplied afterwards). As in the authors' code, token log-ratios are clamped to
    [-20, 20] and the IS logs and the summed log w to [log 1e-8, 20]; φ = exp(λ + k·log w - λ·w) peaks at w = k/λ and is 1 at w = 1. (k, λ) are the positive pair
    for A ≥ 0, else the negative one; non-finite φ become 0.
    """
    m = mask.to(log_ratio.dtype)
    log_w = (torch.clamp(log_ratio.detach(), -20.0, 20.0) * m).sum(-1, keepdim=True)
    if log_is_weights is not None:
        log_w = log_w + (torch.clamp(log_is_weights.detach(), math.log(1e-8), 20.0) * m).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, math.log(1e-8), 20.0)
    adv = _col(advantages)
    positive = adv >= 0
    k = torch.where(positive, torch.full_like(adv, shape.k_pos), torch.full_like(adv, shape.k_neg))
    lam = torch.where(
        positive, torch.full_like(adv, shape.lambda_pos), torch.full_like(adv, shape.lambda_neg)
    )
    lam = lam.clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi)).detach()


def off_policy_mask(
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, eq. 9): M_i [N, 1] in {0, 1}.

    A sequence is dropped (M = 0) when its advantage is negative and its mean log(π_sampler/π_θ)
    over completion tokens exceeds ``threshold``: a sample the current policy has moved far away
    from, which it is then pushed off even harder. As TRL, it multiplies only the policy term, and the
    dropped tokens still count in the normalisers.
    """
    m = mask.to(logps.dtype)
    kl = ((sampler_logps - logps.detach()) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (_col(advantages) >= 0) | (kl <= threshold)
    return keep.to(logps.dtype)


class AdaptiveEntropy:
    """Skywork-OR1's entropy controller (arXiv 2505.22312, §3.2), with TRL's names and defaults.

    After each optimizer step the coefficient moves by ``delta`` towards more bonus when the step's
    mean token entropy was at or below ``target``, and back otherwise, within [``coef_min``,
    ``coef_max``]; the bonus applies only while the last measured entropy is at or below the target
    (none before the first measurement). The state is two floats, checkpointed by the method.

    GRPO measures the entropy of every completion token, as Skywork-OR1 does. With
    ``top_entropy_quantile`` < 1, TRL measures only the tokens that quantile keeps (the highest-entropy
    ones), whose mean sits above a target meant for all tokens, so its bonus would rarely switch on.
    """

    def __init__(
        self, coef: float = 0.0, target: float = 0.2, delta: float = 0.005,
        coef_min: float = 0.0, coef_max: float = 1.0,
    ) -> None:  # fmt: skip
        if not coef_min <= coef <= coef_max:
            raise ValueError(f"entropy_coef {coef} must lie in [entropy_coef_min, entropy_coef_max] = "
                             f"[{coef_min}, {coef_max}]")  # fmt: skip
        if delta < 0:
            raise ValueError(f"entropy_coef_delta must be >= 0, got {delta}")
        self.coef, self.target, self.delta = coef, target, delta
        self.coef_min, self.coef_max = coef_min, coef_max
        self.last_entropy = math.inf

    @property
    def applied(self) -> float:
        """The coefficient the next step's loss uses."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """Fold in the mean token entropy of the optimizer step just taken (over all ranks)."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
