"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv
2402.01306), as TRL's ``KTOTrainer`` computes it, as pure functions.

Inputs are per-example log-probabilities summed over completion tokens, shape [B]; ``desirable`` is
the bool label [B]. r = logπ(y|x) - logπ_ref(y|x) is the implicit reward (divided by β); z0 is the
reference point, an estimate of KL(π‖π_ref) from *mismatched* completions (another row's answer to
this row's prompt), detached and clamped at 0 (eq. 8 of the paper).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KTO_LOSS_TYPES: tuple[str, ...] = ("kto", "apo_zero_unpaired")


def kto_weight_advice(
    num_desirable: int, num_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """Why the weights do not suit the data's label balance, or None when they do.

    The paper recommends λ_D·n_D / (λ_U·n_U) in [1, 4/3] (TRL cites its eq. 8 and warns with the same
    advice: move EITHER weight into its range). TRL checks only when the counts differ; the range holds
    for unequal weights on balanced data too, so this checks it always.
    """
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if weight == 0:
            return f"method.{name} is 0: those rows teach nothing (only one side of KTO's loss is trained)"
    if num_desirable == 0 or num_undesirable == 0:
        side = "undesirable" if num_undesirable == 0 else "desirable"
        return (
            f"the training data has no {side} rows ({num_desirable} desirable, {num_undesirable} "
            f"undesirable): only one side of KTO's loss is trained"
        )
    ratio = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
    if 1.0 <= ratio <= 4.0 / 3.0:
        return None
    d_low = undesirable_weight * num_undesirable / num_desirable
    u_high = desirable_weight * num_desirable / num_undesirable
    return (
        f"desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = {desirable_weight:g} * "
        f"{num_desirable} / ({undesirable_weight:g} * {num_undesirable}) = {ratio:.3g}, outside the paper's "
        f"[1, 4/3]: set EITHER method.desirable_weight in {_inward(d_low, d_low * 4 / 3)} OR "
        f"method.undesirable_weight in {_inward(u_high * 3 / 4, u_high)}"
    )


def _inward(low: float, high: float, digits: int = 3) -> str:
    """``[low, high]`` to ``digits`` significant digits, rounded inwards: any value printed is in range."""

    def rounded(x: float, up: bool) -> float:
        scale = 10.0 ** (digits - 1 - math.floor(math.log10(abs(x))))
        # The 1e-9 keeps a float just past a round number (0.0750000001) from rounding outwards.
        return (math.ceil(x * scale - 1e-9) if up else math.floor(x * scale + 1e-9)) / scale

    return f"[{rounded(low, True):g}, {rounded(high, False):g}]"


def kto_reference_point(kl_logratios: Tensor) -> Tensor:
    """z0 = max(0, mean_j [logπ(y'_j|x_j) - logπ_ref(y'_j|x_j)]), detached.

    Pass the mismatched log-ratios of every rank (gathered): the mean over all examples is the
    paper's estimate. TRL averages the ranks' means instead, which is the same for equal batches.
    """
    if kl_logratios.numel() == 0:
        return kl_logratios.new_zeros(())
    return kl_logratios.detach().mean().clamp(min=0.0)


def kto_losses(
    logratios: Tensor,
    desirable: Tensor,
    z0: Tensor | float | None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> Tensor:
    """Per-example KTO loss [B].

    "kto": λ_D·(1 - σ(β(r - z0))) for desirable examples, λ_U·(1 - σ(β(z0 - r))) for undesirable ones
    (TRL's form of the paper's λ_y - v(x, y)). "apo_zero_unpaired" (D'Oosterlinck et al. 2024, APO):
    no reference point, λ_D·(1 - σ(βr)) and λ_U·σ(βr); ``z0`` is ignored there and may be None. The mean
    over examples is the loss.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"KTO loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    desirable = desirable.bool()
    if loss_type == "apo_zero_unpaired":
        z0 = 0.0
    elif z0 is None:
        raise ValueError("KTO's loss needs the reference point z0 (only apo_zero_unpaired has none)")
    z0 = torch.as_tensor(z0, dtype=logratios.dtype, device=logratios.device).detach()
    # 1 - σ(x) written as σ(-x): no cancellation when σ(x) is close to 1.
    good = desirable_weight * torch.sigmoid(-beta * (logratios - z0))
    if loss_type == "kto":
        bad = undesirable_weight * torch.sigmoid(-beta * (z0 - logratios))
    else:
        bad = undesirable_weight * torch.sigmoid(beta * logratios)
    return torch.where(desirable, good, bad)


def ranking_accuracy(rewards: Tensor, desirable: Tensor) -> Tensor:
    """P(reward of a desirable example > reward of an undesirable one) over all such pairs (ties 0.5):
    the preference accuracy of unpaired data. NaN when either kind is absent."""
    desirable = desirable.bool()
    good, bad = rewards[desirable], rewards[~desirable]
    if good.numel() == 0 or bad.numel() == 0:
        return rewards.new_tensor(float("nan"))
    diff = good.unsqueeze(1) - bad.unsqueeze(0)
    return ((diff > 0).to(rewards.dtype) + 0.5 * (diff == 0).to(rewards.dtype)).mean()


def kto_metrics(
    logratios: Tensor, desirable: Tensor, z0: Tensor | None, beta: float, logps: Tensor
) -> dict[str, Tensor]:
    """TRL's KTO metric names (``rewards/chosen`` = desirable, ``rewards/rejected`` = undesirable), detached.

    ``kl`` (z0) is left out when there is none (apo_zero_unpaired): TRL logs 0 there, which reads as a
    measured KL of 0.
    """
    desirable = desirable.bool()
    rewards = (beta * logratios).detach()
    nan = rewards.new_tensor(float("nan"))
    chosen = rewards[desirable].mean() if desirable.any() else nan
    rejected = rewards[~desirable].mean() if (~desirable).any() else nan
    metrics = {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": ranking_accuracy(rewards, desirable),
        "logps/chosen": logps.detach()[desirable].mean() if desirable.any() else nan,
        "logps/rejected": logps.detach()[~desirable].mean() if (~desirable).any() else nan,
    }
    if z0 is not None:
        metrics["kl"] = z0.detach()
    return metrics
