"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"), as TRL's.

Each prompt gets a pair of sampled completions; the reward functions (or a reward model) pick the chosen
one, and the DPO loss (sigmoid or ipo) is applied against the reference model. The training forward
always carries the prompt's pixel inputs (a bug TRL users hit under vLLM).

``num_candidates`` > 2 (not in TRL) samples that many completions per prompt and keeps the best- and
the worst-scored as the pair, as in "RLHF Workflow" (Dong et al. 2024, arXiv 2405.07863) and iterative
DPO. With a 0/1 reward two samples tie (and teach nothing) with probability p² + (1-p)²: half the
prompts at p = 0.5; of four candidates all tie with probability p⁴ + (1-p)⁴, one prompt in eight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

import torch

from lightning_vlm.generation.base import Rollouts
from lightning_vlm.losses.preference import (
    PreferenceInputs,
    logratio_margin,
    online_pair_loss,
    reward_accuracy,
)
from lightning_vlm.methods.dynamic_sampling import select_completions
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.methods.online_kwargs import OnlineKwargs
from lightning_vlm.methods.online_metrics import log_synced
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import pooled_means

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def best_and_worst(rewards: torch.Tensor, k: int, excluded: torch.Tensor | None = None) -> list[int]:
    """Indices (best, worst) of each consecutive group of ``k`` rewards; the first of equals wins. A NaN
    (unscored), or an ``excluded`` candidate, is never picked over a scored one; a group with one scored
    value gives a tie (skipped)."""
    if excluded is not None:
        rewards = rewards.masked_fill(excluded, float("nan"))
    grouped = rewards.view(-1, k)
    best = grouped.nan_to_num(-torch.inf).argmax(-1)
    worst = grouped.nan_to_num(torch.inf).argmin(-1)
    return [i * k + int(j) for i in range(len(grouped)) for j in (best[i], worst[i])]


class OnlineDPO(OnlineRL):
    """A pair per prompt (the best and worst of ``num_candidates``), the higher-scored chosen; tied or
    unscored pairs are skipped."""

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        num_generations: int = 2,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        missing_eos_penalty: float | None = None,
        num_candidates: int = 4,
        vllm_importance_sampling_correction: bool = False,
        disable_dropout: bool = True,
        **online: Unpack[OnlineKwargs],
    ) -> None:
        if num_generations != 2:
            raise ValueError(
                f"Online DPO compares two completions: num_generations must be 2, got {num_generations}"
            )
        if not isinstance(num_candidates, int) or num_candidates < 2:
            raise ValueError(f"num_candidates (samples per prompt the pair is picked from) must be >= 2, "
                             f"got {num_candidates!r}")  # fmt: skip
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            # TRL's OnlineDPOConfig takes a list, one β per epoch (the last one kept): no schedule here.
            raise ValueError(f"method.beta is one number for the whole run (TRL's per-epoch list of betas is "
                             f"not supported), got {beta!r}")  # fmt: skip
        if not beta > 0:
            raise ValueError(f"Online DPO needs beta > 0 (the loss scales by it), got {beta}")
        # DPO's loss compares the pair's log-ratios to the reference; it is not a policy-gradient estimate
        # over the sampler's distribution, so a sampler/trainer IS weight has nothing to reweigh (TRL's
        # OnlineDPOTrainer has none). Accepting the setting would cost a forward pass and change nothing.
        if vllm_importance_sampling_correction:
            raise ValueError(
                "Online DPO applies no importance-sampling correction (its DPO loss takes no ratio to the "
                "sampler): set method.vllm_importance_sampling_correction=false"
            )
        if online.get("mask_truncated_completions") and missing_eos_penalty is not None:
            raise ValueError(
                "method.mask_truncated_completions drops every pair with a truncated answer (no evidence either "
                "way), the answers method.missing_eos_penalty makes the rejected ones: set one of them"
            )
        micro = online.get("micro_batch_size")
        if micro is not None and micro % 2:
            raise ValueError(f"micro_batch_size must be even so pairs stay together, got {micro}")
        super().__init__(vlm, optimizer, num_generations=num_generations, beta=beta,
                         vllm_importance_sampling_correction=False, disable_dropout=disable_dropout,
                         **online)  # fmt: skip

    @property
    def needs_reference(self) -> bool:
        return True

    @property
    def reads_old_logps(self) -> bool:
        # Its loss reads the current and the reference log-probs only, also when the policy moves
        # between generation and loss (num_iterations or steps_per_generation > 1): no old-policy pass.
        return False

    @property
    def logps_temperature(self) -> float:
        # DPO's objective is on the policy itself: the temperature only shapes the sampling, as in TRL's
        # OnlineDPOTrainer (plain log-softmax); dividing by it would change the loss and its effective β.
        return 1.0

    @property
    def step_unit(self) -> int:
        return 2  # a pair is one loss term: it never spans micro-batches or steps

    @property
    def samples_per_prompt(self) -> int:
        return self.hparams.num_candidates

    def penalized(self, rewards: torch.Tensor, truncated: list[bool]) -> torch.Tensor:
        """Rewards minus ``missing_eos_penalty`` for completions without an end of turn (TRL subtracts)."""
        if self.hparams.missing_eos_penalty is None:
            return rewards
        cut = torch.tensor(truncated, device=rewards.device, dtype=rewards.dtype)
        return rewards - self.hparams.missing_eos_penalty * cut

    def train_rewards(self, rollouts: Rollouts, per_function: torch.Tensor) -> torch.Tensor:
        """The rewards dynamic sampling filters on: those pairs are picked and judged by
        (``missing_eos_penalty`` can break a tie, or make one), a masked truncated candidate's left out (it
        is in no pair): a group needs two finished candidates that differ."""
        rewards = self.penalized(self.scorer.total(per_function), rollouts.truncated)
        if self.hparams.mask_truncated_completions:
            cut = torch.tensor(rollouts.truncated, device=rewards.device)
            rewards = rewards.masked_fill(cut, float("nan"))
        return rewards

    def sample(self, pool: list[dict]) -> tuple[Rollouts, torch.Tensor]:
        """Sample ``num_candidates`` per prompt and keep (best, worst) by reward: the pair to train on."""
        rollouts, per_function = super().sample(pool)
        k = self.hparams.num_candidates
        if rollouts.num_generations != k:
            raise ValueError(f"the generator returned {rollouts.num_generations} completions per prompt, "
                             f"num_candidates={k} were asked for")  # fmt: skip
        if k == 2:
            return rollouts, per_function
        rewards = self.penalized(self.scorer.total(per_function), rollouts.truncated)
        # Masked, a truncated candidate could only make a pair that is dropped (compute_advantages).
        cut = torch.tensor(rollouts.truncated, device=rewards.device)
        index = best_and_worst(rewards, k, cut if self.hparams.mask_truncated_completions else None)
        # Over every rank's scored candidates (a rank short of prompts weighs less), as one process.
        scored = ~rewards.isnan()
        mean = pooled_means({"reward": torch.nanmean(rewards)}, scored.sum())["reward"]
        log_synced(self, {"train/candidates/reward": mean}, len(pool))
        picked = select_completions(rollouts, range(len(rollouts.rows)), index, 2)
        return picked, per_function[torch.tensor(index)]

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """+1 for chosen, -1 for rejected, 0 for skipped pairs; the choice is kept in ``batch.extras``."""
        rewards = self.penalized(batch.rewards.clone(), batch.rollouts.truncated)
        pairs = rewards.view(-1, 2)
        # A tie (or a missing score) says nothing about which answer is better: no pair, no gradient.
        valid = ~pairs.isnan().any(-1) & (pairs[:, 0] != pairs[:, 1])
        if self.hparams.mask_truncated_completions:
            # A masked (truncated) answer has no log-probs: its pair would push the other up against nothing.
            cut = torch.tensor(batch.rollouts.truncated, device=valid.device).view(-1, 2)
            valid &= ~cut.any(-1)
        first_chosen = pairs[:, 0] > pairs[:, 1]
        batch.extras.update(pair_valid=valid, first_chosen=first_chosen)
        sign = torch.stack([first_chosen, ~first_chosen], -1).to(rewards.dtype) * 2 - 1
        # Over every rank's pairs: a rank short of prompts (an uneven last batch) weighs less.
        frac = pooled_means({"frac": valid.float().mean()}, len(pairs))["frac"]
        log_synced(self, {"train/valid_pair_frac": frac}, len(pairs))
        return (sign * valid.unsqueeze(-1)).reshape(-1)

    def step_counts(self, batch: RolloutBatch, index: torch.Tensor) -> dict[str, torch.Tensor]:
        # The loss is a mean over the step's valid pairs (of all ranks).
        counts = super().step_counts(batch, index)
        counts["pairs"] = batch.extras["pair_valid"][index.view(-1, 2)[:, 0] // 2].sum()
        # Counts are floored at 1 / world size (global_counts), which hides a step with no valid pair on
        # any rank; one more per rank never reaches the floor: exactly 1 then.
        counts["pairs_and_ranks"] = counts["pairs"] + 1
        return counts

    def loss(
        self, batch: RolloutBatch, index: torch.Tensor, step: Step, logps: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        if len(index) % 2 or len(step.index) % 2:
            raise ValueError("Online DPO needs whole pairs per micro-batch and optimizer step (even sizes)")
        mask = batch.completion_mask[index].to(logps.dtype)
        pair = index.view(-1, 2)[:, 0] // 2
        valid = batch.extras["pair_valid"][pair]
        # Each pair as (chosen, rejected): its second completion first where that one won.
        order = torch.stack(
            [~batch.extras["first_chosen"][pair], batch.extras["first_chosen"][pair]], -1
        ).long()

        def chosen_rejected(per_completion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pairs = per_completion.view(-1, 2).gather(1, order)
            return pairs[:, 0], pairs[:, 1]

        inputs = PreferenceInputs(
            *chosen_rejected((logps * mask).sum(-1)),
            *chosen_rejected((batch.ref_logps[index] * mask).sum(-1)),
            *chosen_rejected(mask.sum(-1)),
        )
        per_pair = online_pair_loss(self.hparams.loss_type, inputs, self.hparams.beta)
        loss = (per_pair * valid).sum() / step.counts["pairs"]
        with torch.no_grad():
            # Pooled over the step's valid pairs of every rank, as the loss: a micro-batch (or rank) of
            # ties must not add zeros. The loop weighs a micro-batch's stats by its share of the step's
            # completions (online.py); this undoes that weight.
            n = step.counts["pairs"] * len(index) / len(step.index)
            margin = logratio_margin(
                inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.ref_chosen_logps,
                inputs.ref_rejected_logps,
            )  # fmt: skip
            stats = {
                "rewards/margins": (self.hparams.beta * margin * valid).sum() / n,
                "rewards/accuracies": (reward_accuracy(margin) * valid).sum() / n,
                "logps/chosen": (inputs.policy_chosen_logps * valid).sum() / n,
                "logps/rejected": (inputs.policy_rejected_logps * valid).sum() / n,
            }
            if step.counts["pairs_and_ranks"] == 1:  # a step of ties: nothing to describe, left out (NaN)
                stats = {k: torch.full_like(v, float("nan")) for k, v in stats.items()}
        return loss, stats
