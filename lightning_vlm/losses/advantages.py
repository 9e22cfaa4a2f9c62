"""Rewards to advantages for online RL: GRPO group scaling, Dr. GRPO, RLOO leave-one-out.

Missing rewards (a reward function returned None) travel as NaN, as in TRL: they are left out of
every statistic and their sample gets advantage 0, so it adds nothing to the policy gradient.
Standard deviations are the unbiased (Bessel, n-1) estimate, like TRL's ``torch.std``, everywhere
in this file; a statistic over fewer than two valid rewards has std 0. Statistics are computed in
float64 and results returned in the rewards' dtype: the squares (and sums) of rewards near
float32's limit (a reward function returning 1e38) overflow float32 to an inf std, which would
silently zero every advantage.
"""

from __future__ import annotations

from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def as_float64(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64, for statistics that must not overflow (on the CPU for MPS, which has none)."""
    return (x.cpu() if x.device.type == "mps" else x).double()


def _nan_std(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std ignoring NaN, computed in float64 (returned in ``x``'s dtype and device); 0 where
    fewer than two values are valid."""
    dtype, device = x.dtype, x.device
    x = as_float64(x)
    valid = ~torch.isnan(x)
    n = valid.sum(dim=dim, keepdim=True) if dim is not None else valid.sum()
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    ss = sq.sum(dim=dim, keepdim=True) if dim is not None else sq.sum()
    std = torch.sqrt(ss / (n - 1).clamp(min=1))
    std = torch.where(n >= 2, std, torch.zeros_like(std))
    return (std if keepdim or dim is None else std.squeeze(dim)).to(device, dtype)


def _check_groups(rewards: torch.Tensor, num_generations: int) -> None:
    """Fail early with the shapes instead of a cryptic view() error."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of num_generations={num_generations}"
        )


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum over reward functions, NaN-skipping: r_i = Σ_f w_f·r_if (TRL's ``reward_weights``).

    A sample for which every function returned None stays NaN (missing) rather than becoming 0,
    so it is excluded from group statistics instead of counting as a zero reward.
    """
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be [N, F], got shape {tuple(per_function.shape)}")
    if weights is None:
        weights = torch.ones(per_function.shape[1], dtype=per_function.dtype, device=per_function.device)
    weights = weights.to(per_function)
    if weights.shape != (per_function.shape[1],):
        raise ValueError(f"weights must be [{per_function.shape[1]}], got shape {tuple(weights.shape)}")
    # Summed in float64 so large rewards add up without overflowing on the way.
    total = torch.nansum(as_float64(per_function) * as_float64(weights), dim=1).to(per_function)
    all_missing = torch.isnan(per_function).all(dim=1)
    return torch.where(all_missing, torch.full_like(total, float("nan")), total)


def reward_stats(per_function: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [F], unbiased std [F]) of each reward function over the batch, ignoring NaN."""
    mean = torch.nanmean(as_float64(per_function), dim=0).to(per_function)
    return mean, _nan_std(per_function, dim=0)


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i - mean_g(r)) / (std + eps).

    ``scale_rewards``: "group" divides by the group's std (GRPO); "batch" by the std of all valid
    rewards in ``rewards`` (Liu et al. 2025, "Tricks or Traps", group mean + batch std); "none"
    does not divide (Dr. GRPO, Liu et al. 2025, which removes the std's difficulty bias). Rows are
    consecutive groups of ``num_generations`` completions of one prompt. For "batch" under data
    parallelism, pass the gathered rewards so every rank uses the same std.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    _check_groups(rewards, num_generations)
    dtype, device = rewards.dtype, rewards.device
    rewards = as_float64(rewards)
    grouped = rewards.view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    mean = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0)
    adv = torch.where(valid, grouped - mean, torch.zeros_like(grouped))
    if scale_rewards == "group":
        adv = adv / (_nan_std(grouped, dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        adv = adv / (_nan_std(rewards) + eps)
    # r - mean(r) can be a few ulps off zero when all rewards are equal (0.1 + 0.1 + 0.1 != 0.3),
    # which eps-division would blow up to ~1e-4; a constant group carries no signal, so force 0.
    hi = torch.where(valid, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=1, keepdim=True)
    lo = torch.where(valid, grouped, torch.full_like(grouped, torch.inf)).amin(dim=1, keepdim=True)
    adv = torch.where(hi == lo, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(device, dtype)


def rloo_advantages(
    rewards: torch.Tensor, num_generations: int, normalize: bool = False, eps: float = 1e-4
) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - Σ_{j≠i} r_j / (G-1).

    Missing (NaN) rewards are left out of the baselines and get advantage 0; a sample whose group
    has no other valid reward has no baseline and gets 0 too. ``normalize`` rescales the valid
    advantages of the whole batch to mean 0 and unbiased std 1 (TRL's ``normalize_advantages``).
    """
    _check_groups(rewards, num_generations)
    if num_generations < 2:
        raise ValueError(
            f"RLOO needs num_generations >= 2 for a leave-one-out baseline, got {num_generations}"
        )
    dtype, device = rewards.dtype, rewards.device
    grouped = as_float64(rewards).view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    filled = torch.where(valid, grouped, torch.zeros_like(grouped))
    others = valid.sum(dim=1, keepdim=True) - valid.to(torch.long)  # valid rewards besides i
    baseline = (filled.sum(dim=1, keepdim=True) - filled) / others.clamp(min=1)
    keep = valid & (others >= 1)
    adv = torch.where(keep, filled - baseline, torch.zeros_like(filled)).reshape(-1)
    if normalize:
        kept = keep.reshape(-1)
        masked = torch.where(kept, adv, torch.full_like(adv, float("nan")))
        mean = torch.nanmean(masked).nan_to_num(0.0)
        adv = torch.where(kept, (adv - mean) / (_nan_std(masked) + eps), torch.zeros_like(adv))
    return adv.to(device, dtype)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    logps_old: torch.Tensor,
    logps_ref: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """RLOO's KL-in-reward (Ahmadian et al. 2024): r_i - β·Σ_t mask·(logp_old - logp_ref), k1 estimator.

    The KL is a property of the sampled sequence, so it is summed (not averaged) over tokens and
    computed without gradient: it shapes the reward, not the loss. Missing rewards stay NaN.
    """
    kl = ((logps_old - logps_ref).detach() * mask.to(logps_old.dtype)).sum(dim=-1)
    return rewards - beta * kl.to(rewards.dtype)


AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")


def decoupled_advantages(
    per_function: torch.Tensor, weights: torch.Tensor, num_generations: int, eps: float = 1e-4
) -> torch.Tensor:
    """GDPO (arXiv 2601.05242), TRL's ``multi_objective_aggregation="normalize_then_sum"``.

    Each reward function's rewards are group-normalised on their own, Â_k = (r_k - mean_g) /
    (std_g + eps), so a reward with a wide range cannot drown a binary one; the weighted sum
    S = Σ_k w_k·Â_k is then normalised over the batch, (S - mean) / (std + eps). A missing reward
    (NaN) drops out of its function's statistics and adds 0 to S; a completion no function scored
    gets advantage 0 and stays out of the batch statistics. For data parallelism pass the gathered
    rewards (the batch statistics are over every rank's completions, as TRL's).
    """
    if per_function.dim() != 2 or per_function.shape[1] != weights.numel():
        raise ValueError(
            f"per_function must be [N, F] with F = {weights.numel()} weights, got {tuple(per_function.shape)}"
        )
    dtype, device = per_function.dtype, per_function.device
    columns = [
        group_advantages(per_function[:, k], num_generations, "group", eps) for k in range(weights.numel())
    ]
    summed = (as_float64(torch.stack(columns, dim=1)) * as_float64(weights.to(per_function))).sum(dim=1)
    scored = ~torch.isnan(as_float64(per_function)).all(dim=1)
    valid = torch.where(scored, summed, torch.full_like(summed, float("nan")))
    mean = torch.nanmean(valid).nan_to_num(0.0)
    adv = torch.where(scored, (summed - mean) / (_nan_std(valid) + eps), torch.zeros_like(summed))
    return adv.to(device, dtype)
