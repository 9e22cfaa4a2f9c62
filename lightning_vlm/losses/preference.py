"""Pure preference losses (DPO family) and their weighted combination, as TRL's DPO `loss_type` list.

Every loss takes per-example tensors (log-probabilities summed over completion tokens, shape [B]) and
returns a per-example loss of shape [B]; nothing here touches a model, so each formula can be checked
against hand-computed numbers. Notation: ρ = logπ(y|x) - logπ_ref(y|x) (the implicit reward / β) and
Δ = ρ⁺ - ρ⁻ (chosen minus rejected), the "logits" of TRL's DPOTrainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_vlm.losses.normalizers import divisor

LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "bco_pair", "robust", "sft")
# How the `sft` term averages: per pair, then over pairs (ours), or over all chosen tokens (TRL's).
SFT_NORMALIZATIONS: tuple[str, ...] = ("per_example", "token_mean")


@dataclass
class PreferenceInputs:
    """Summed completion log-probs of policy and reference for chosen/rejected answers, and token counts."""

    policy_chosen_logps: Tensor
    policy_rejected_logps: Tensor
    ref_chosen_logps: Tensor
    ref_rejected_logps: Tensor
    chosen_lengths: Tensor
    rejected_lengths: Tensor


def logratio_margin(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
) -> Tensor:
    """Δ = (logp⁺ - ref⁺) - (logp⁻ - ref⁻), the DPO margin of implicit rewards (divided by β)."""
    return (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)


def reward_accuracy(margin: Tensor) -> Tensor:
    """Per pair: 1 when the chosen answer's implicit reward is above the rejected one's (Δ > 0), 0 when
    below, 0.5 for a tie; ``rewards/accuracies`` of DPO and Online DPO alike.

    A tie (policy == reference, e.g. before the first step) is a coin flip, not a miss: an untrained
    policy reads 0.5 rather than 0.
    """
    return (margin > 0).to(margin.dtype) + 0.5 * (margin == 0).to(margin.dtype)


def sigmoid_loss(margin: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO (Rafailov et al. 2023) with cDPO smoothing ε: -(1-ε)·logσ(βΔ) - ε·logσ(-βΔ).

    ε > 0 treats each label as flipped with probability ε (conservative DPO, Mitchell 2023); the
    loss then has its minimum at a finite margin instead of pushing Δ to infinity. TRL 1.16's
    ``sigmoid`` ignores ``label_smoothing`` (its cDPO is gone; ``robust`` is its only smoothed loss),
    so with ε > 0 our ``sigmoid`` is cDPO, not TRL's plain DPO; ε = 0 (the default) is identical.
    """
    logits = beta * margin
    # logsigmoid, not log(sigmoid(x)): sigmoid underflows to 0 at x ≈ -100 in float32 and log(0) = -inf.
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def robust_loss(margin: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """rDPO (Chowdhury et al. 2024): ((1-ε)·(-logσ(βΔ)) - ε·(-logσ(-βΔ))) / (1 - 2ε).

    Unlike cDPO this is an unbiased estimate of the clean-label DPO loss under label-flip rate ε
    (it can be negative per example); ε = 0 gives plain DPO. Requires ε < 1/2.
    """
    logits = beta * margin
    return ((1.0 - label_smoothing) * -F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)) / (
        1.0 - 2.0 * label_smoothing
    )


def hinge_loss(margin: Tensor, beta: float) -> Tensor:
    """SLiC-HF (Zhao et al. 2023) hinge on the reference-corrected margin: relu(1 - βΔ)."""
    return torch.relu(1.0 - beta * margin)


def ipo_loss(normalized_margin: Tensor, beta: float) -> Tensor:
    """IPO (Azar et al. 2023): (Δ̄ - 1/(2β))², Δ̄ the margin of token-averaged log-probs (as TRL's
    DPOTrainer does; Online DPO passes the summed margin, see ``online_pair_loss``).

    The square regresses the margin to a finite target 1/(2β) instead of maximising it, which is
    IPO's fix for DPO overfitting deterministic preferences; averaging over tokens keeps that
    target meaningful whatever the answer lengths.
    """
    return (normalized_margin - 1.0 / (2.0 * beta)) ** 2


def bco_pair_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, delta: float | Tensor = 0.0
) -> Tensor:
    """BCO (Jung et al. 2024), paired form used by MPO: -logσ(βρ⁺ - δ) - logσ(-(βρ⁻ - δ)).

    Chosen and rejected are classified independently (chosen reward above δ, rejected below), so
    the chosen likelihood cannot be bought by only lowering the rejected one. δ is the running
    mean of the rewards (see `RunningMean`); δ = 0 gives the simplified form.
    """
    return -F.logsigmoid(beta * chosen_logratios - delta) - F.logsigmoid(-(beta * rejected_logratios - delta))


def sft_nll_loss(
    policy_chosen_logps: Tensor,
    chosen_lengths: Tensor,
    normalization: str = "per_example",
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """NLL of the chosen answers (MPO's generation loss), as a [B] tensor whose mean is the term.

    "per_example" (default): -logp⁺_i / |y⁺_i|, each pair's token mean, so every pair weighs the same
    as in the other terms and the value does not depend on which pairs share a batch.
    "token_mean" (TRL's ``sft``): the batch mean is Σ_i -logp⁺_i / Σ_i |y⁺_i|, so long answers weigh
    more; returned as -logp⁺_i · B / ``num_tokens`` (default Σ_i |y⁺_i|; pass the count over all
    ranks, see ``DPO``, for N processes to match one). Empty answers count as one token (no 0/0).
    """
    if normalization not in SFT_NORMALIZATIONS:
        raise ValueError(f"sft_normalization must be one of {SFT_NORMALIZATIONS}, got {normalization!r}")
    lengths = chosen_lengths.to(policy_chosen_logps.dtype)
    if normalization == "per_example":
        return -policy_chosen_logps / lengths.clamp(min=1.0)
    tokens = lengths.sum().clamp(min=1.0) if num_tokens is None else divisor(num_tokens, lengths)
    return -policy_chosen_logps * policy_chosen_logps.shape[0] / tokens


class RunningMean(nn.Module):
    """Cumulative mean of the rewards, BCO's δ; kept in buffers so it is checkpointed with the module."""

    mean: Tensor
    count: Tensor

    def __init__(self) -> None:
        """Start at δ = 0 with no observations."""
        super().__init__()
        self.register_buffer("mean", torch.zeros(()))
        # int64 so that module.to(bfloat16) (Lightning "bf16-true") cannot round the count.
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def update(self, values: Tensor) -> Tensor:
        """Fold `values` (gather them across ranks first under DDP) into the mean; returns the new mean."""
        values = values.detach().flatten()
        n = values.numel()
        if n == 0:
            return self.mean.clone()
        total = self.count.item() + n
        # Accumulate in float64: the float32 mean of many small updates would drift.
        new_mean = self.mean.double() + (values.double().mean() - self.mean.double()) * (n / total)
        self.mean.copy_(new_mean.to(self.mean.dtype))
        self.count.fill_(total)
        return self.mean.clone()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RunningMean:
        # A cast of the whole module (Lightning "bf16-true", DeepSpeed's bf16) must not reach δ: in
        # bfloat16 an update falls under half an ulp once the count is large, and δ stops moving.
        # Device moves still apply. The float32 value is kept and only moved: casting the cast buffer back
        # would restore its dtype, not the digits bfloat16 rounded away (a resume casts after the restore).
        mean = self.mean
        super()._apply(fn, recurse)
        self.mean = mean.to(device=self.mean.device, dtype=torch.float32)
        return self

    def forward(self) -> Tensor:
        """The current mean (δ)."""
        return self.mean


# The terms that take label_smoothing (cDPO's and rDPO's ε).
SMOOTHED = {"sigmoid", "robust"}


def _validate(
    loss_types: Sequence[str], loss_weights: Sequence[float] | None, beta: float, label_smoothing: float
) -> list[float]:
    """Fail before any maths with an error that names the bad setting; returns the weights."""
    if isinstance(loss_types, str):
        # A bare string would otherwise be iterated character by character.
        raise TypeError(f"loss_types must be a list of names, e.g. ['{loss_types}'], not a string")
    if len(loss_types) == 0:
        raise ValueError(f"loss_types is empty; choose from {list(LOSS_TYPES)}")
    unknown = [t for t in loss_types if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"unknown preference loss type(s) {unknown}; valid types are {list(LOSS_TYPES)}")
    if len(set(loss_types)) != len(loss_types):
        raise ValueError(
            f"loss_types has duplicates {list(loss_types)}; give one entry per type and use loss_weights"
        )
    weights = [1.0] * len(loss_types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(loss_types):
        raise ValueError(
            f"loss_weights has {len(weights)} entries but loss_types has {len(loss_types)}: {list(loss_types)}"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (ipo divides by it, the others scale by it), got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        # At ε = 0.5 robust divides by zero and sigmoid stops depending on which answer was chosen.
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and not SMOOTHED & set(loss_types):
        # The other terms have no smoothed form: the setting would be dropped without a word.
        raise ValueError(
            f"label_smoothing={label_smoothing} applies only to sigmoid and robust, and loss_types is "
            f"{list(loss_types)}; set it to 0 or add one of them"
        )
    return weights


def weighted_preference_loss(
    loss_types: Sequence[str],
    loss_weights: Sequence[float] | None,
    inputs: PreferenceInputs,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    bco_delta: float | Tensor = 0.0,
    sft_normalization: str = "per_example",
    sft_num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_k w_k · mean_B(loss_k) over TRL-style loss types, with detached TRL-named metrics.

    Only ipo sees length-averaged log-probs, as in TRL 1.x's ipo term; every other term keeps summed
    log-probs, also when ipo is in the list.
    ``sft_normalization`` and ``sft_num_tokens``: see ``sft_nll_loss``.
    """
    weights = _validate(loss_types, loss_weights, beta, label_smoothing)
    if sft_normalization not in SFT_NORMALIZATIONS:
        raise ValueError(f"sft_normalization must be one of {SFT_NORMALIZATIONS}, got {sft_normalization!r}")
    shape = inputs.policy_chosen_logps.shape
    for name in ("policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps"):
        if getattr(inputs, name).shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(getattr(inputs, name).shape)}, expected {tuple(shape)}"
            )

    chosen_logratios = inputs.policy_chosen_logps - inputs.ref_chosen_logps
    rejected_logratios = inputs.policy_rejected_logps - inputs.ref_rejected_logps
    margin = chosen_logratios - rejected_logratios

    metrics: dict[str, Tensor] = {}
    total = torch.zeros((), dtype=margin.dtype, device=margin.device)
    for loss_type, weight in zip(loss_types, weights, strict=True):
        per_example = per_example_loss(
            loss_type, inputs, beta, label_smoothing, bco_delta, sft_normalization, sft_num_tokens
        )
        component = per_example.mean()
        total = total + weight * component
        metrics[f"loss/{loss_type}"] = component.detach()

    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios
        rejected_rewards = beta * rejected_logratios
        metrics["rewards/chosen"] = chosen_rewards.mean()
        metrics["rewards/rejected"] = rejected_rewards.mean()
        metrics["rewards/margins"] = (chosen_rewards - rejected_rewards).mean()
        metrics["rewards/accuracies"] = reward_accuracy(margin).mean()
        metrics["logps/chosen"] = inputs.policy_chosen_logps.mean()
        metrics["logps/rejected"] = inputs.policy_rejected_logps.mean()
    return total, metrics


def online_pair_loss(loss_type: str, inputs: PreferenceInputs, beta: float) -> Tensor:
    """Online DPO's [B] loss, as TRL's OnlineDPOTrainer: ``sigmoid``, or ``ipo`` on the margin of *summed*
    log-probs (the IPO paper's h; TRL's offline DPOTrainer averages ipo's log-probs per token, its online
    trainer does not). Averaged, the target 1/(2β) sits |y| times nearer the reference."""
    if loss_type == "ipo":
        margin = logratio_margin(
            inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.ref_chosen_logps,
            inputs.ref_rejected_logps,
        )  # fmt: skip
        return ipo_loss(margin, beta)
    if loss_type == "sigmoid":
        return per_example_loss(loss_type, inputs, beta)
    raise ValueError(f"Online DPO's loss_type is sigmoid or ipo, got {loss_type!r}")


def per_example_loss(
    loss_type: str,
    inputs: PreferenceInputs,
    beta: float,
    label_smoothing: float = 0.0,
    bco_delta: float | Tensor = 0.0,
    sft_normalization: str = "per_example",
    sft_num_tokens: float | Tensor | None = None,
) -> Tensor:
    """The [B] loss of one loss type (the only string switch): DPO's terms and Online DPO's loss."""
    chosen_logratios = inputs.policy_chosen_logps - inputs.ref_chosen_logps
    rejected_logratios = inputs.policy_rejected_logps - inputs.ref_rejected_logps
    margin = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return sigmoid_loss(margin, beta, label_smoothing)
    if loss_type == "robust":
        return robust_loss(margin, beta, label_smoothing)
    if loss_type == "hinge":
        return hinge_loss(margin, beta)
    if loss_type == "ipo":
        dtype = margin.dtype
        chosen_len = inputs.chosen_lengths.to(dtype).clamp(min=1.0)
        rejected_len = inputs.rejected_lengths.to(dtype).clamp(min=1.0)
        normalized = logratio_margin(
            inputs.policy_chosen_logps / chosen_len,
            inputs.policy_rejected_logps / rejected_len,
            inputs.ref_chosen_logps / chosen_len,
            inputs.ref_rejected_logps / rejected_len,
        )
        return ipo_loss(normalized, beta)
    if loss_type == "bco_pair":
        return bco_pair_loss(chosen_logratios, rejected_logratios, beta, bco_delta)
    if loss_type == "sft":
        return sft_nll_loss(
            inputs.policy_chosen_logps, inputs.chosen_lengths, sft_normalization, sft_num_tokens
        )
    raise ValueError(f"unknown preference loss type {loss_type!r}; valid types are {list(LOSS_TYPES)}")
