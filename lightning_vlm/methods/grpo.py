"""GRPO (Shao et al. 2024) and, by configuration, GSPO (Zheng et al. 2025; ``importance_sampling_level: sequence``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

import torch

from lightning_vlm.losses.advantages import SCALE_REWARDS, group_advantages
from lightning_vlm.losses.policy import LEVELS, LOSS_TYPES, policy_loss
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.methods.online_kwargs import OnlineKwargs
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step
from lightning_vlm.models.vlm import VLM


class GRPO(OnlineRL):
    """Group-normalised advantages and the clipped surrogate (+ β·k3 KL), TRL's settings and names."""

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        scale_rewards: str = "group",
        top_entropy_quantile: float = 1.0,
        **online: Unpack[OnlineKwargs],
    ) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if importance_sampling_level not in LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}"
            )
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
        if not 0.0 < top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
        if epsilon <= 0 or (epsilon_high is not None and epsilon_high <= 0):
            raise ValueError(f"epsilon and epsilon_high must be > 0, got {epsilon}, {epsilon_high}")
        super().__init__(vlm, optimizer, **online)

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """(r - group mean) / (std + 1e-4), std of the group, the batch (all ranks'), or none (Dr. GRPO)."""
        hp = self.hparams
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
        if hp.top_entropy_quantile < 1.0 and entropy is not None and mask.any():
            # Train only on the highest-entropy ("forking") tokens (Wang et al. 2025), as TRL: the others'
            # surrogate is zeroed, but they still count in the normalisers and the KL term.
            threshold = torch.quantile(entropy[mask.bool()].detach(), 1.0 - hp.top_entropy_quantile)
            entropy_mask = mask * (entropy.detach() >= threshold).to(mask.dtype)
        loss, stats = policy_loss(
            logps,
            None if batch.old_logps is None else batch.old_logps[index],
            batch.advantages[index],
            mask,
            ref_logps=None if batch.ref_logps is None else batch.ref_logps[index],
            beta=hp.beta,
            epsilon_low=hp.epsilon,
            epsilon_high=hp.epsilon_high,
            level=hp.importance_sampling_level,
            loss_type=hp.loss_type,
            is_weights=None if batch.is_weights is None else batch.is_weights[index],
            entropy_mask=entropy_mask,
            max_completion_length=self.sampling.max_new_tokens,
            # Normalisers of the whole optimizer step over all ranks, so neither accumulation nor the
            # number of processes changes the update.
            num_items_in_batch=step.tokens,
            num_sequences_in_batch=step.sequences,
        )
        if hp.loss_type == "bnpo":
            # Local by definition (TRL): each micro-batch's token mean, weighted by its share of the step.
            loss = loss * len(index) / step.sequences
        return loss, stats
