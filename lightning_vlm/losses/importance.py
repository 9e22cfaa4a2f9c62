"""Rollout/trainer mismatch correction: importance weights for completions sampled by vLLM.

vLLM samples with its own kernels (and often another precision), so its log-probs differ from
the trainer's even at identical weights; the policy gradient is then off-policy. The correction
reweights the loss by ρ = π_trainer(y) / π_sampler(y) = exp(old_logps - sampler_logps), bounded to
[C_min, C_max] (TRL's ``vllm_importance_sampling_clip_min`` / ``_clip_max``; C_min unset by default):
"truncate" is truncated IS, w = clamp(ρ, C_min, C_max) (TIS, Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training"); "mask" is masked IS, w = ρ inside the bounds
else 0 (MIS, Liu et al. 2025, "When Speed Kills Stability"), which drops the worst-mismatched samples
instead of keeping them at a bound. TRL's ``vllm_importance_sampling_mode`` strings ("token_truncate",
"sequence_mask", ...) map to (level, mode) through ``split_trl_mode``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Level = Literal["token", "sequence"]
Mode = Literal["truncate", "mask"]
LEVELS: tuple[str, ...] = ("token", "sequence")
MODES: tuple[str, ...] = ("truncate", "mask")
_LOG_W_MAX = 20.0  # the largest log-weight kept, whatever C_max: e^20 ≈ 4.9e8, finite in float32


def split_trl_mode(trl_mode: str) -> tuple[Level, Mode]:
    """TRL's ``vllm_importance_sampling_mode`` (e.g. "sequence_mask") -> ("sequence", "mask")."""
    level, _, mode = trl_mode.partition("_")
    if level not in LEVELS or mode not in MODES:
        valid = [f"{lv}_{md}" for lv in LEVELS for md in MODES]
        raise ValueError(f"importance sampling mode must be one of {valid}, got {trl_mode!r}")
    return level, mode  # type: ignore[return-value]


def check_clip_bounds(clip_min: float | None, clip_max: float | None, mode: Mode = "mask") -> None:
    """Refuses bounds that are no ratio range (a ratio is > 0, so C_max must be > 0 and C_min ≥ 0), and,
    as TRL does, C_min ≥ C_max and a truncation with neither bound."""
    if mode == "truncate" and clip_min is None and clip_max is None:
        raise ValueError(
            "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or "
            "vllm_importance_sampling_clip_max (both are null)"
        )
    if clip_max is not None and clip_max <= 0:
        raise ValueError(f"vllm_importance_sampling_clip_max must be > 0 or null, got {clip_max}")
    if clip_min is not None and clip_min < 0:
        raise ValueError(f"vllm_importance_sampling_clip_min must be >= 0 or null, got {clip_min}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({clip_min}) must be below vllm_importance_sampling_clip_max "
            f"({clip_max})"
        )


def rollout_correction(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    level: Level = "token",
    mode: Mode = "truncate",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bounded IS weights [N, T] (detached, 0 on padding) for trainer ``old_logps`` vs ``sampler_logps``;
    a bound that is None (or C_min 0) leaves that side open. Weights stop at e^20 whatever C_max, where a
    sequence's summed log-ratio would overflow exp to inf and padding's inf·0 to NaN (TRL's is inf).

    "token": ρ_t = exp(old_t - sampler_t), one weight per token. "sequence": ρ_i =
    exp(Σ_t (old_t - sampler_t)), the product of token ratios, i.e. the exact likelihood ratio of
    the whole sampled completion, because the sample is drawn per sequence; a length-normalised
    (GSPO-style geometric mean) ratio would be a biased correction and would hide a long sequence's
    accumulated drift. Every token of sequence i carries ρ_i. Metrics, over tokens or sequences:
    ratio mean/min/max before bounding (NaN without a completion token: there is nothing to describe),
    "is_ratio/capped_frac" (outside the bounds: truncated or masked), and the k3 estimate of
    KL(π_sampler‖π_trainer) per token (samples come from the sampler).
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_clip_bounds(clip_min, clip_max, mode)
    # In log space: a sequence's summed log-ratio easily exceeds exp's float32 range.
    low = math.log(clip_min) if clip_min else -math.inf
    high = math.log(clip_max) if clip_max is not None else math.inf
    finite = min(high, _LOG_W_MAX)
    with torch.no_grad():
        m = mask.to(old_logps.dtype)
        token_log_ratio = (old_logps - sampler_logps).detach() * m
        if level == "token":
            log_w = token_log_ratio
            units = mask.bool()
        else:
            log_w = token_log_ratio.sum(-1, keepdim=True)
            units = mask.bool().any(-1, keepdim=True)
        outside = (log_w > high) | (log_w < low)
        w = torch.exp(torch.clamp(log_w, min=low, max=finite))
        if mode == "mask":
            w = torch.where(outside, torch.zeros_like(w), w)
        weights = torch.where(mask.bool(), w.expand_as(m), torch.zeros_like(m))

        ratio = torch.exp(log_w)[units]  # may be inf for a wildly off sequence: logged as such
        n_units = units.sum().clamp(min=1)
        k3 = torch.exp(token_log_ratio) - token_log_ratio - 1.0  # 0 on padding since log-ratio is 0
        empty = ratio.numel() == 0
        zero, nan = old_logps.new_zeros(()), old_logps.new_full((), math.nan)
        metrics = {
            "is_ratio/mean": nan if empty else ratio.mean(),
            "is_ratio/min": nan if empty else ratio.min(),
            "is_ratio/max": nan if empty else ratio.max(),
            "is_ratio/capped_frac": (outside & units).sum() / n_units,  # truncated or masked, by mode
            "sampler_kl": (k3 * m).sum() / m.sum().clamp(min=1.0),
            "sampler_logp_diff/max": (token_log_ratio.abs()).max() if m.numel() else zero,
        }
    return weights, metrics
