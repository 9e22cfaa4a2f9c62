"""RLOO (Ahmadian et al. 2024) as TRL's RLOOTrainer: leave-one-out baseline, KL in the reward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_vlm.generation.base import SamplingOptions
from lightning_vlm.losses.advantages import kl_penalized_rewards, rloo_advantages
from lightning_vlm.losses.rloo import rloo_loss
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step
from lightning_vlm.models.vlm import VLM


class RLOO(OnlineRL):
    """A_i = r_i - mean of the other G-1 rewards, r penalised by β·Σ_t(logp_old - logp_ref); sequence-level clip."""

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        reward_funcs: Sequence[Any] = ("accuracy_reward",),
        reward_weights: Sequence[float] | None = None,
        reward_model: Any | None = None,
        num_generations: int = 8,
        num_iterations: int = 1,
        steps_per_generation: int = 1,
        micro_batch_size: int | None = None,
        max_completion_length: int = 16,
        sampling: SamplingOptions | Mapping[str, Any] | None = None,
        beta: float = 0.05,
        mask_truncated_completions: bool = False,
        max_grad_norm: float | None = 1.0,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "sequence_mask",
        vllm_importance_sampling_cap: float = 3.0,
        val_num_generations: int = 4,
        val_seed: int = 1234,
        seed: int | None = 0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        normalize_advantages: bool = False,
    ) -> None:
        if num_generations < 2:
            raise ValueError(f"RLOO needs num_generations >= 2, got {num_generations}")
        super().__init__(
            vlm=vlm,
            optimizer=optimizer,
            scheduler=scheduler,
            reward_funcs=reward_funcs,
            reward_weights=reward_weights,
            reward_model=reward_model,
            num_generations=num_generations,
            num_iterations=num_iterations,
            steps_per_generation=steps_per_generation,
            micro_batch_size=micro_batch_size,
            max_completion_length=max_completion_length,
            sampling=sampling,
            beta=beta,
            mask_truncated_completions=mask_truncated_completions,
            max_grad_norm=max_grad_norm,
            vllm_importance_sampling_correction=vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=vllm_importance_sampling_mode,
            vllm_importance_sampling_cap=vllm_importance_sampling_cap,
            val_num_generations=val_num_generations,
            val_seed=val_seed,
            seed=seed,
        )
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
            stats["kl"] = ((batch.old_logps[index] - batch.ref_logps[index]) * mask).sum(-1).mean()
        return loss, stats
