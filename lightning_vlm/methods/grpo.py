"""GRPO (Shao et al. 2024) and, by configuration, GSPO (Zheng et al. 2025; ``importance_sampling_level:
sequence``), DAPO (``method=dapo``) and TRL's newer losses (cispo, sapo, luspo, vespo), clipping
(``delta``), masks, KL and entropy terms and GDPO's reward aggregation (``losses.policy``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, Unpack

import torch

from lightning_vlm.defaults import init_defaults
from lightning_vlm.losses.advantages import (
    AGGREGATIONS,
    SCALE_REWARDS,
    decoupled_advantages,
    group_advantages,
)
from lightning_vlm.losses.policy import CLIPPED, LEVELS, LOSS_TYPES, policy_loss
from lightning_vlm.losses.policy_variants import AdaptiveEntropy, VespoShape
from lightning_vlm.methods.dynamic_sampling import any_reward_std_filter
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.methods.online_kwargs import OnlineKwargs
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import all_reduce_sum, gather_cat, gather_sizes, launcher_rank

_ENTROPY_KEY = "lightning_vlm/adaptive_entropy"
log = logging.getLogger(__name__)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def level_advice(loss_type: str, level: str) -> list[str]:
    """Why a loss type and importance-sampling level do not suit each other (TRL warns about the same
    three pairings); empty when they do. They still run: the combinations are legal, only unusual."""
    advice = []
    if loss_type == "luspo" and level != "sequence":
        advice.append(
            "loss_type=luspo is defined at importance_sampling_level=sequence (the LUSPO paper's setup)"
        )
    if loss_type == "vespo" and level != "token":
        advice.append("loss_type=vespo builds its sequence weight from token ratios itself: leave "
                      "importance_sampling_level at token")  # fmt: skip
    if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        advice.append(f"loss_type={loss_type} sums per-token terms, so at importance_sampling_level=sequence each "
                      "sequence weighs by its length; GSPO's objective is loss_type=grpo (method=gspo)")  # fmt: skip
    return advice


# The settings only some configurations read: (setting, the loss types or switch that reads it).
_READ_BY: dict[str, tuple[str, ...]] = {
    "epsilon": CLIPPED,
    "epsilon_high": (*CLIPPED, "cispo"),
    **{f"sapo_temperature_{s}": ("sapo",) for s in ("pos", "neg")},
    **{f"vespo_{p}_{s}": ("vespo",) for p in ("k", "lambda") for s in ("pos", "neg")},
    **{k: ("use_adaptive_entropy",) for k in ("entropy_target", "entropy_coef_delta", "entropy_coef_min",
                                              "entropy_coef_max")},
}  # fmt: skip


# The settings that shape the loss only through the ratio π/π_old (cispo's cap below 1 acts at r = 1 too).
_RATIO_SETTINGS = ("epsilon", "epsilon_high", "delta", "sapo_temperature_pos", "sapo_temperature_neg",
                   "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")  # fmt: skip


def unread_settings(
    settings: dict[str, Any], defaults: dict[str, Any], policy_moves: bool = True
) -> list[str]:
    """The settings changed from their ``defaults`` that the chosen ``loss_type`` (and
    ``use_adaptive_entropy``) never read, as ``method.<name>=<value> (read by ...)``, and, when the policy
    cannot move between generation and loss (``policy_moves`` false: one optimizer step per generation),
    those that act only through a ratio, which is then 1. TRL ignores both without a word, so a sweep over
    them would compare identical runs."""
    on = {settings["loss_type"], *(["use_adaptive_entropy"] if settings["use_adaptive_entropy"] else [])}
    changed = [name for name in defaults if name in settings and settings[name] != defaults[name]]
    reasons = {
        name: f"read by {' / '.join(_READ_BY[name])}"
        for name in changed
        if name in _READ_BY and not on & set(_READ_BY[name])
    }
    if not policy_moves:
        for name in changed:
            cap = name == "epsilon_high" and settings["loss_type"] == "cispo" and settings[name] < 1
            if name in _RATIO_SETTINGS and name not in reasons and not cap:
                reasons[name] = ("every ratio is 1 with one optimizer step per generation: set "
                                 "method.steps_per_generation or num_iterations > 1")  # fmt: skip
    order = [*_READ_BY, *_RATIO_SETTINGS]  # the message names them in this order
    return [
        f"method.{name}={settings[name]!r} ({reasons[name]})" for name in sorted(reasons, key=order.index)
    ]


def linear_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q)`` (linear interpolation) of a 1-D ``x`` of any size: ``torch.quantile``
    refuses more than 2**24 elements, which a micro-batch's tokens gathered from many ranks can reach."""
    ordered = x.sort().values
    position = q * (ordered.numel() - 1)
    low = int(position)  # floor: position >= 0
    high = min(low + 1, ordered.numel() - 1)
    return torch.lerp(
        ordered[low], ordered[high], torch.tensor(position - low, dtype=x.dtype, device=x.device)
    )


class GRPO(OnlineRL):
    """Group-normalised advantages and the clipped surrogate (+ β·k3 KL), TRL's settings and names."""

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        scale_rewards: str = "group",
        multi_objective_aggregation: str = "sum_then_normalize",
        top_entropy_quantile: float = 1.0,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: float | None = None,
        use_bias_correction_kl: bool = False,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        entropy_target: float = 0.2,
        **online: Unpack[OnlineKwargs],
    ) -> None:
        _check(loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        _check(importance_sampling_level in LEVELS,
               f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}")  # fmt: skip
        _check(
            scale_rewards in SCALE_REWARDS,
            f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}",
        )
        _check(multi_objective_aggregation in AGGREGATIONS,
               f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {multi_objective_aggregation!r}")  # fmt: skip
        # TRL ignores scale_rewards under GDPO without a word; a setting that does nothing is refused.
        _check(multi_objective_aggregation == "sum_then_normalize" or scale_rewards == "group",
               "multi_objective_aggregation=normalize_then_sum normalises each reward by its group's std and "
               f"the sum by the batch's: scale_rewards={scale_rewards!r} would be ignored; leave it at 'group'")  # fmt: skip
        _check(
            0.0 <= top_entropy_quantile <= 1.0,  # 0: the highest-entropy token alone (TRL's reading too)
            f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}",
        )
        _check(epsilon > 0 and (epsilon_high is None or epsilon_high > 0),
               f"epsilon and epsilon_high must be > 0, got {epsilon}, {epsilon_high}")  # fmt: skip
        # TRL falls back to epsilon (0.2) here, which caps every IS weight near 1 at 0.2.
        _check(loss_type != "cispo" or epsilon_high is not None,
               "loss_type=cispo caps the IS weight at epsilon_high, an absolute bound (MiniMax-M1's eps_max; "
               "ScaleRL uses 5.0): set method.epsilon_high")  # fmt: skip
        _check(delta is None or delta > 1.0, f"delta (two-sided clipping) must be > 1, got {delta}")
        _check(delta is None or loss_type in CLIPPED,
               f"delta caps the clipped surrogate's ratio, which loss_type={loss_type} does not have (only "
               f"{', '.join(CLIPPED)} do): leave method.delta null")  # fmt: skip
        _check(sapo_temperature_pos > 0 and sapo_temperature_neg > 0,
               f"sapo temperatures must be > 0, got {sapo_temperature_pos}, {sapo_temperature_neg}")  # fmt: skip
        _check(not use_bias_correction_kl or online.get("beta", 0.0) > 0,
               "use_bias_correction_kl corrects the KL term: it needs method.beta > 0")  # fmt: skip
        _check(off_policy_mask_threshold is None or off_policy_mask_threshold >= 0,
               f"off_policy_mask_threshold must be >= 0, got {off_policy_mask_threshold}")  # fmt: skip
        super().__init__(vlm, optimizer, **online)
        # A group of one has no spread: every advantage is 0 (under every scale_rewards and GDPO), so only
        # the KL and entropy terms would train. TRL's GRPOConfig refuses it too.
        _check(self.hparams.num_generations >= 2,
               f"GRPO compares completions within a group: num_generations must be >= 2, got "
               f"{self.hparams.num_generations} (every advantage would be 0)")  # fmt: skip
        unread = unread_settings(dict(self.hparams), init_defaults(GRPO), self.policy_moves)
        unread_advice = [f"these settings do nothing here: {', '.join(unread)}"] if unread else []
        for advice in [*level_advice(loss_type, importance_sampling_level), *unread_advice]:
            if launcher_rank() == 0:  # every rank builds the module; one warning is enough
                log.warning("GRPO: %s", advice)
        if multi_objective_aggregation == "normalize_then_sum" and self.dynamic_sampling.filter == "zero_std":
            # GDPO's advantages are 0 only where every weighted reward ties in the group (not only the total).
            gdpo_filter = functools.partial(any_reward_std_filter, weights=self.scorer.weights)
            self.dynamic_sampling = dataclasses.replace(self.dynamic_sampling, filter=gdpo_filter)
        self.vespo_shape = VespoShape(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
        self.entropy_control: AdaptiveEntropy | None = None
        if use_adaptive_entropy:
            self.entropy_control = AdaptiveEntropy(
                entropy_coef, entropy_target, entropy_coef_delta, entropy_coef_min, entropy_coef_max
            )
        self._step_entropy = torch.zeros(2)  # Σ entropy·mask and Σ mask of this optimizer step

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus of the next loss: fixed, or the adaptive controller's current value."""
        if self.entropy_control is not None:
            return self.entropy_control.applied
        return self.hparams.entropy_coef

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """(r - group mean) / (std + 1e-4), std of the group, the batch (all ranks'), or none (Dr. GRPO);
        or GDPO's per-reward group normalisation, then the batch's."""
        hp = self.hparams
        if hp.multi_objective_aggregation == "normalize_then_sum":
            gathered = batch.shard.gather(batch.per_function)
            everyone = decoupled_advantages(gathered, self.scorer.weights, hp.num_generations)
            return batch.shard.local(everyone)
        if hp.scale_rewards != "batch":
            return group_advantages(batch.rewards, hp.num_generations, hp.scale_rewards)
        # TRL's batch std is over the whole generation batch: every rank's rewards.
        everyone = group_advantages(batch.shard.gather(batch.rewards), hp.num_generations, "batch")
        return batch.shard.local(everyone)

    def loss(
        self, batch: RolloutBatch, index: torch.Tensor, step: Step, logps: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        hp = self.hparams
        mask = batch.completion_mask[index].to(logps.dtype)
        entropy_mask = None
        if hp.top_entropy_quantile < 1.0 and entropy is not None:
            entropy_mask = self._top_entropy_mask(entropy, mask)
        is_weights = None if batch.is_weights is None else batch.is_weights[index]
        if is_weights is not None:  # a sampler that is not the policy (a server) may show up only here
            self._check_vespo_correction()
        bonus = hp.entropy_coef != 0.0 or self.entropy_control is not None
        if self.entropy_control is not None and entropy is not None:
            # Skywork-OR1's controller watches the mean entropy of every response token (the top-entropy
            # subset's mean would sit above any target).
            measured = torch.stack([(entropy.detach() * mask).sum(), mask.sum()])
            self._step_entropy = self._step_entropy.to(measured.device) + measured
        sampler_logps = None if self.sampler_is_policy(batch.rollouts) else batch.sampler_logps
        loss, stats = policy_loss(
            logps,
            None if batch.old_logps is None else batch.old_logps[index],
            batch.advantages[index],
            mask,
            ref_logps=None if batch.ref_logps is None else batch.ref_logps[index],
            beta=hp.beta,
            epsilon_low=hp.epsilon,
            epsilon_high=hp.epsilon_high,
            delta=hp.delta,
            level=hp.importance_sampling_level,
            loss_type=hp.loss_type,
            sapo_temperatures=(hp.sapo_temperature_pos, hp.sapo_temperature_neg),
            vespo_shape=self.vespo_shape,
            is_weights=is_weights,
            # The mask measures how far the policy moved from the sampler. The policy's own sampling (HF
            # generate) is the old policy: its scores are reshaped by top_p/top_k (every sample would look
            # off-policy), and TRL has no sampler log-probs there either.
            sampler_logps=None if sampler_logps is None else sampler_logps[index].to(logps),
            off_policy_mask_threshold=hp.off_policy_mask_threshold,
            use_bias_correction_kl=hp.use_bias_correction_kl,
            entropy_mask=entropy_mask,
            entropy=entropy if bonus else None,
            entropy_coef=self.entropy_coef,
            # bnpo is local by definition (TRL): each micro-batch's token mean, weighted by its share of the step.
            policy_scale=len(index) / step.sequences if hp.loss_type == "bnpo" else 1.0,
            max_completion_length=self.sampling.max_new_tokens,
            # Normalisers of the whole optimizer step over all ranks, so neither accumulation nor the
            # number of processes changes the update.
            num_items_in_batch=step.tokens,
            num_sequences_in_batch=step.sequences,
        )
        if bonus:
            stats["entropy_coef"] = torch.tensor(self.entropy_coef, device=loss.device)
            # A share of the step's loss, like the loss: the loop weighs stats by the micro-batch's size.
            stats["policy_loss"] = stats["policy_loss"] * len(step.index) / len(index)
        return loss, stats

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.hparams.vllm_importance_sampling_correction and not self.generator.is_policy:
            self._check_vespo_correction()  # before the first generation, as TRL checks it in __init__

    def _check_vespo_correction(self) -> None:
        """vespo takes the rollout IS ratios per token; a sequence-level correction mode cannot feed it."""
        if self.hparams.loss_type == "vespo" and self.is_level != "token":
            raise ValueError(
                "loss_type=vespo folds the rollout IS ratios into its sequence weight, one per token: set "
                "method.vllm_importance_sampling_mode to token_truncate (token_mask zeroes a whole sequence "
                "for one masked token, as in TRL and the authors' code)"
            )

    def _top_entropy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Train only on the highest-entropy ("forking") tokens (Wang et al. 2025), as TRL: the others'
        surrogate is zeroed, but they still count in the normalisers and the KL term. The threshold is the
        quantile of this micro-batch's tokens on every rank (two collectives, made by every rank), so N
        processes pick the tokens one process would with their micro-batches together."""
        local = entropy[mask.bool()].detach().float()
        sizes = gather_sizes(local.numel(), local.device)
        if sum(sizes) == 0:
            return None
        threshold = linear_quantile(gather_cat(local, sizes), 1.0 - self.hparams.top_entropy_quantile)
        return mask * (entropy.detach() >= threshold).to(mask.dtype)

    def on_policy_update(self) -> None:
        super().on_policy_update()
        if self.entropy_control is None:
            return
        # The step's mean entropy over every rank's trained tokens (one small collective).
        total, count = all_reduce_sum(self._step_entropy.to(self.device)).tolist()
        self._step_entropy = torch.zeros(2, device=self.device)
        if count > 0:
            self.entropy_control.update(total / count)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.entropy_control is not None:
            checkpoint[_ENTROPY_KEY] = self.entropy_control.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.entropy_control is not None and _ENTROPY_KEY in checkpoint:
            self.entropy_control.load_state_dict(checkpoint[_ENTROPY_KEY])
