"""Clipped policy-gradient surrogate (PPO/GRPO/GSPO), k3 KL and the loss aggregations of TRL.

All inputs are per-token log-probs of the sampled completion tokens, shape [N, T], with a 0/1
completion ``mask`` [N, T]; advantages are per sequence [N]. Nothing here reads a model.

Gradient accumulation and data parallelism. The token-sum losses ("dapo", "dr_grpo", and "grpo"
given ``num_sequences_in_batch``) are linear in the per-token terms, so if every micro-batch
divides by the normaliser of its *whole* optimizer step (active tokens for "dapo", sequences for
"dr_grpo"/"grpo", over all its micro-batches and ranks), the sum of the micro-batch losses equals the
full-batch loss, and so do the
gradients: batch 1 × accumulation 4 == batch 4 × accumulation 1. A local normaliser instead
weighs a token by the length of its micro-batch. Two framework scalings must be undone by the
caller: Lightning's automatic optimisation divides each micro-batch loss by
``accumulate_grad_batches`` (multiply it back, or use manual optimisation), and DDP averages
gradients over ranks (pass the global normaliser divided by the world size, as TRL does).
"bnpo" is local by definition and is not accumulation-invariant. The newer types reduce like one of
these (cispo and vespo as "dapo", sapo as "grpo"; luspo sums over tokens and divides by sequences), so
the same holds for them; the entropy bonus divides by the step's tokens for every type.

With several optimizer steps per generation (``steps_per_generation``), each step divides by its own
count, as the DAPO paper's token-level mean over a training batch and verl's "token-mean" do. TRL
divides every step by the whole generation's count instead, which weighs a step's loss by its share of
the generation's tokens; with one step per generation (TRL's and our default) the two are the same.
"""

from __future__ import annotations

from typing import Literal

import torch

from lightning_vlm.losses.kl import Level, k3_kl, kl_correction_ratio
from lightning_vlm.losses.normalizers import capped_exp, divisor
from lightning_vlm.losses.policy_variants import (
    VESPO_DEFAULT,
    VespoShape,
    cispo_per_token,
    off_policy_mask,
    sapo_per_token,
    vespo_weights,
)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# The loss types built on the clipped surrogate (the others have their own per-token term).
CLIPPED: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# How each loss type reduces its per-token loss (TRL's pairing): the newer types reuse four of them.
AGGREGATION: dict[str, str] = {"cispo": "dapo", "vespo": "dapo", "sapo": "grpo"}
LEVELS: tuple[str, ...] = ("token", "sequence")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over active tokens; 0 (not NaN) for an empty mask."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _level_mean(x: torch.Tensor, mask: torch.Tensor, level: Level) -> torch.Tensor:
    """Mean of a per-token statistic: over active tokens, or at sequence level over sequences (each once).

    At sequence level the value is the same on every token of a sequence, so a token mean would weigh long
    answers more; TRL counts each sequence once there (its ``global_masked_mean`` of a (B, 1) tensor).
    """
    if level == "token":
        return _masked_mean(x, mask)
    m = mask.to(x.dtype)
    tokens = m.sum(-1)
    per_sequence = (x * m).sum(-1) / tokens.clamp(min=1.0)
    # A sequence without active tokens (masked as truncated) has no value: it is left out, not counted as 0.
    return (per_sequence * (tokens > 0)).sum() / (tokens > 0).sum().clamp(min=1)


def _masked_min_max(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of x over active tokens; (NaN, NaN) for an empty mask: no extreme to report, and a
    step's extremes over its micro-batches (methods/online.py) skip it, where a 0 would be the minimum."""
    active = mask.bool()
    if not active.any():
        nan = x.new_full((), float("nan"))
        return nan, nan
    return x[active].min(), x[active].max()


def importance_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: Level = "token"
) -> torch.Tensor:
    """Log importance ratio [N, T]: token log(π/π_old), or GSPO's sequence log s_i on every token.

    "token" (PPO/GRPO): log r_it = logp_it - old_it.
    "sequence" (GSPO, Zheng et al. 2025): log s_i = (1/|y_i|) Σ_t (logp_it - old_it), the
    length-normalised sequence likelihood ratio. It is returned in the paper's GSPO-token form,
    log s_it = sg[log s_i] + logp_it - sg[logp_it]: every token's value is log s_i, so clipping
    acts per sequence, and ∂s_it/∂θ = s_i·∇logp_it. Averaged over a sequence's tokens this is
    exactly GSPO's ∇s_i = s_i·(1/|y_i|) Σ_t ∇logp_it; under token-sum aggregations it equals
    broadcasting the differentiable s_i to all tokens (TRL's form). Unlike that form it stays
    correct when per-token weights (e.g. rollout IS weights) differ inside a sequence.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    m = mask.to(logps.dtype)
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return logps - logps.detach() + seq_log_ratio.detach().unsqueeze(-1)


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    level: Level = "token",
    delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) per token: -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A).

    Asymmetric ε (DAPO's clip-higher, Yu et al. 2025); ``epsilon_high`` defaults to ``epsilon_low``
    as in TRL. ``delta`` (INTELLECT-2's two-sided clipping, arXiv 2505.07291) caps r at δ in the
    unclipped term only, as TRL: for A < 0 that term was unbounded, so one sample far off-policy could
    dominate a step; for A > 0 it changes nothing once δ > 1 + ε_h. Stats over active tokens: "clip_ratio/low" (r < 1-ε_l with A < 0) and
    "clip_ratio/high" (r > 1+ε_h with A > 0) are the tokens whose gradient the clip zeroes,
    "clip_ratio/region" their union; "ratio/mean|min|max" describe r. At sequence level the fractions
    and the mean count sequences, not tokens (as TRL).
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = capped_exp(importance_ratio(logps, old_logps, mask, level))
    unclipped = (ratio if delta is None else torch.clamp(ratio, max=delta)) * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)

    with torch.no_grad():
        r = ratio.detach()
        low = ((r < 1.0 - epsilon_low) & (adv < 0)).to(r.dtype)
        high = ((r > 1.0 + eps_high) & (adv > 0)).to(r.dtype)
        r_min, r_max = _masked_min_max(r, mask)
        stats = {
            "clip_ratio/low": _level_mean(low, mask, level),
            "clip_ratio/high": _level_mean(high, mask, level),
            "clip_ratio/region": _level_mean(torch.clamp(low + high, max=1.0), mask, level),
            "ratio/mean": _level_mean(r, mask, level),
            "ratio/min": r_min,
            "ratio/max": r_max,
        }
    return per_token, stats


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_sequences_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [N, T] to a scalar, with TRL's ``loss_type`` semantics.

    grpo (Shao et al. 2024): Σ_i (Σ_t l·m / Σ_t m) / N (sequence means; long answers weigh less).
    bnpo: Σ l·m / Σ m over the local batch.
    dr_grpo (Liu et al. 2025): Σ l·m / (N · max_completion_length), a constant normaliser;
    ``max_completion_length`` defaults to T.
    dapo (Yu et al. 2025): Σ l·m / (active tokens of the whole optimizer step), passed as
    ``num_items_in_batch`` (default: the local Σ m).
    ``num_sequences_in_batch`` replaces N for grpo and dr_grpo (default: local N). See the module
    docstring for why the normalisers must be global under gradient accumulation. The newer types
    reduce as TRL: cispo and vespo as dapo, sapo as grpo, luspo as Σ l·m / N (length-weighted).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    m = mask.to(per_token.dtype)
    num_seqs = per_token.shape[0] if num_sequences_in_batch is None else num_sequences_in_batch
    if loss_type == "luspo":
        # LUSPO (arXiv 2602.05261): each sequence's loss times its length, Σ_i Σ_t l·m / N, which undoes
        # GSPO's length normalisation. TRL (2026-07) computes (l · |y_i|).mean() over B×T instead: the same
        # when l is constant over a sequence (sequence level, beta = 0, no per-token weights), deliberately
        # not followed otherwise. With a KL, token-level ratios, an entropy mask or per-token IS weights,
        # TRL's value weighs each token by |y_i|/T, padding cells included; the paper's Σ|y_i|·l_i/N is kept.
        return (per_token * m).sum() / divisor(num_seqs, per_token)
    loss_type = AGGREGATION.get(loss_type, loss_type)
    masked = per_token * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / divisor(num_seqs, per_token)
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = per_token.shape[-1] if max_completion_length is None else max_completion_length
        return masked.sum() / divisor(num_seqs * length, per_token)
    tokens = m.sum().clamp(min=1.0) if num_items_in_batch is None else divisor(num_items_in_batch, per_token)
    return masked.sum() / tokens


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    level: Level = "token",
    loss_type: LossType = "dapo",
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo_shape: VespoShape = VESPO_DEFAULT,
    is_weights: torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    off_policy_mask_threshold: float | None = None,
    use_bias_correction_kl: bool = False,
    entropy_mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    policy_scale: float | torch.Tensor = 1.0,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_sequences_in_batch: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO objective (Shao et al. 2024, eq. 3) and TRL's variants -> (loss, detached metrics).

    The per-token term is the clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo; with ``delta``),
    CISPO's, SAPO's or VESPO's (``policy_variants``); then, in TRL's order: × the off-policy sequence
    mask (``off_policy_mask_threshold``, against ``sampler_logps``, else ``old_logps``), × ``entropy_mask``,
    × the rollout IS weights (not for vespo, which folds them into its weight), + β·k3 KL (× the
    ratio π/π_old with ``use_bias_correction_kl``, DeepSeek-V3.2's unbiased KL estimate), aggregated,
    times ``policy_scale`` (bnpo's share of the step), and minus ``entropy_coef`` times the entropy
    of the tokens trained on when ``entropy`` is given (it must carry its gradient; ``policy_loss`` is
    then the part before the bonus). That entropy is summed over ``mask`` × ``entropy_mask`` and divided
    by ``num_items_in_batch`` (every completion token of the step) for every loss type, so micro-batching
    does not change it: the mean entropy without ``entropy_mask``, about ``top_entropy_quantile`` times
    the trained tokens' mean with it. TRL does the same for cispo, dapo and vespo; for the other types it
    divides by the micro-batch's trained tokens, a value micro-batching changes (the step's trained
    tokens are known only after every micro-batch's forward pass, too late for the first backward).

    ``old_logps=None`` means on-policy (one optimisation step per generation): π_old = sg[π], so
    r = 1 in value but gradients still flow. The IS weights correct for sampling from the rollout
    engine; the KL term is already an expectation under the trainer's own samples, so it is not
    reweighted. ``entropy_mask`` (``top_entropy_quantile``) zeroes the surrogate of the other tokens:
    the KL term and the loss normalisers still count every token of ``mask``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if old_logps is None:
        old_logps = logps.detach()
    if loss_type in CLIPPED:
        per_token, metrics = clipped_surrogate(
            logps, old_logps, advantages, mask, epsilon_low, epsilon_high, level, delta
        )
    else:
        per_token, metrics = _variant_per_token(
            loss_type, logps, old_logps, advantages, mask, level, epsilon_high, sapo_temperatures,
            vespo_shape, is_weights,
        )  # fmt: skip
    if off_policy_mask_threshold is not None:
        sampled = old_logps if sampler_logps is None else sampler_logps
        keep = off_policy_mask(logps, sampled, advantages, mask, off_policy_mask_threshold)
        per_token = per_token * keep
        # Over sequences with active tokens (as the other statistics): a fully masked one is no sample.
        metrics["off_policy_mask/masked_frac"] = 1.0 - _level_mean(keep.expand_as(mask), mask, "sequence")
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.detach()
    if is_weights is not None and loss_type != "vespo":
        per_token = per_token * is_weights.detach()
        metrics["is_weight/mean"] = _masked_mean(is_weights.detach(), mask)
    if ref_logps is not None and beta != 0.0:
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:
            kl = kl * kl_correction_ratio(logps, old_logps, mask, level)
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = policy_scale * aggregate(
        per_token, mask, loss_type, max_completion_length, num_items_in_batch, num_sequences_in_batch
    )
    if entropy is not None:
        metrics["policy_loss"] = loss.detach()
        trained = mask.to(entropy.dtype) * (1.0 if entropy_mask is None else entropy_mask.detach())
        tokens = (
            mask.sum().clamp(min=1) if num_items_in_batch is None else divisor(num_items_in_batch, entropy)
        )
        loss = loss - entropy_coef * (entropy * trained).sum() / tokens
    return loss, metrics


def _variant_per_token(
    loss_type: str,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    level: Level,
    epsilon_high: float | None,
    sapo_temperatures: tuple[float, float],
    vespo_shape: VespoShape,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of cispo, sapo or vespo, with TRL's metric names."""
    log_ratio = importance_ratio(logps, old_logps, mask, level)
    ratio = capped_exp(log_ratio)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    if loss_type == "cispo":
        if epsilon_high is None:
            raise ValueError("cispo caps the IS weight at epsilon_high (absolute, e.g. 5.0): set it")
        high = ((ratio.detach() > epsilon_high) & (adv > 0)).to(ratio.dtype)
        return cispo_per_token(logps, ratio, advantages, epsilon_high), {
            "cispo_clip_ratio": _level_mean(high, mask, level)
        }
    if loss_type == "sapo":
        return sapo_per_token(ratio, advantages, *sapo_temperatures), {}
    token_log_ratio = logps.detach() - old_logps  # VESPO's w is the product of token ratios
    log_is = None if is_weights is None else torch.log(is_weights.detach().clamp(min=1e-30))
    phi = vespo_weights(token_log_ratio, mask, advantages, vespo_shape, log_is)
    return -phi * adv * logps, {"vespo/phi_seq_mean": phi.mean()}
