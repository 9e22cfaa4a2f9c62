"""RLOO (Ahmadian et al. 2024) as TRL's RLOOTrainer: leave-one-out baseline, KL in the reward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

import torch

from lightning_vlm.losses.advantages import kl_penalized_rewards, rloo_advantages
from lightning_vlm.losses.rloo import mean_token_kl, rloo_loss
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.methods.online_kwargs import OnlineKwargs
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step
from lightning_vlm.models.vlm import VLM


class RLOO(OnlineRL):
    """A_i = r_i - mean of the other G-1 rewards, r penalised by β·Σ_t(logp_old - logp_ref); sequence-level clip."""

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        beta: float = 0.05,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        normalize_advantages: bool = False,
        **online: Unpack[OnlineKwargs],
    ) -> None:
        super().__init__(vlm, optimizer, beta=beta, **online)
        if self.hparams.num_generations < 2:
            raise ValueError(f"RLOO needs num_generations >= 2, got {self.hparams.num_generations}")
        if self.hparams.vllm_importance_sampling_correction and self.is_level != "sequence":
            raise ValueError(
                "RLOO's loss is per sequence: vllm_importance_sampling_mode must be sequence_truncate or "
                f"sequence_mask, got {self.hparams.vllm_importance_sampling_mode!r}"
            )

    @property
    def policy_moves(self) -> bool:
        # The KL-in-reward reads the sampling policy's log-probs even when the update is on-policy.
        return super().policy_moves or self.hparams.beta > 0

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Leave-one-out advantages of the KL-penalised rewards (optionally batch-normalised)."""
        hp = self.hparams
        rewards = batch.rewards
        if hp.beta > 0:
            rewards = kl_penalized_rewards(
                rewards, batch.old_logps, batch.ref_logps, batch.completion_mask, hp.beta
            )
            penalized = torch.nanmean(batch.shard.gather(rewards))
            self.log("train/penalized_reward", penalized, batch_size=len(batch.rollouts.rows))
        if not hp.normalize_advantages:
            return rloo_advantages(rewards, hp.num_generations)
        # The normalisation is over the whole generation batch: every rank's advantages.
        everyone = rloo_advantages(batch.shard.gather(rewards), hp.num_generations, normalize=True)
        return batch.shard.local(everyone)

    def loss(
        self, batch: RolloutBatch, index: torch.Tensor, step: Step, logps: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        hp = self.hparams
        mask = batch.completion_mask[index].to(logps.dtype)
        # On-policy (one step per generation) the ratio is 1 in value: old = sg[logp] gives the same
        # gradient as the frozen old log-probs without their float noise.
        on_policy = not super().policy_moves
        old = None if on_policy or batch.old_logps is None else batch.old_logps[index]
        advantages = batch.advantages[index]
        if batch.is_weights is not None:
            # vLLM sampling: each sequence's term carries its (capped) rollout IS weight.
            advantages = advantages * batch.is_weights[index].amax(-1)
        loss, stats = rloo_loss(
            logps, old, advantages, mask, hp.epsilon, hp.epsilon_high, num_sequences_in_batch=step.sequences
        )
        if batch.ref_logps is not None:
            stats["kl"] = mean_token_kl(batch.old_logps[index], batch.ref_logps[index], mask)
        return loss, stats
