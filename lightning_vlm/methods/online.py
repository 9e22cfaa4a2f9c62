"""The online-RL loop every online method shares: generate, score, advantages, optimise; top to bottom.

One ``training_step`` is one generation: the prompt batch gets ``num_generations`` completions each from
``self.generator``, the rewards and advantages are computed once, and then ``num_iterations`` ×
``steps_per_generation`` optimizer steps run over those rollouts (manual optimisation; an epoch's short last
batch that does not split evenly gets steps one completion (or Online DPO pair) apart, never more steps than
completions; each step accumulates micro-batches of ``micro_batch_size`` completions and divides by
normalisers of the whole step, so micro-batch 1 × 4 == micro-batch 4 × 1; ``step_layout`` gives every rank
as many steps and micro-batches). The rollouts live only inside the step and sampling is seeded from
(``seed``, ``global_step``, rank), so a checkpoint taken between steps needs neither a buffer nor RNG state
to continue the same run.

On several processes each rank generates for its own prompts; the step normalisers and TRL's
whole-batch statistics are reduced over all ranks (``parallel.collectives``), so N processes with
batch B compute the update of one process with batch N·B.

For a vLLM callback: ``self.generator`` may be replaced by any ``Generator``; generation happens at the
start of ``training_step`` (after ``on_train_batch_start``), and the weights changed since the last
generation iff ``trainer.global_step`` moved (``on_policy_update`` runs after every optimizer step).
A generator that is not the policy itself (``Generator.is_policy`` False: the vLLM ones) gets TRL's
importance-sampling correction from its per-token ``Rollouts.logprobs``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, ClassVar

import torch
from torchmetrics import MeanMetric

from lightning_vlm.generation.base import Generator, SamplingOptions, SamplingSettings, seeded
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.losses.importance import check_clip_bounds, rollout_correction, split_trl_mode
from lightning_vlm.methods.common import (
    clip_gradients,
    configure_optimizers,
    greedy_answer_hits,
    turn_off_dropout,
)
from lightning_vlm.methods.completions import CompletionRecorder, rollout_samples
from lightning_vlm.methods.dynamic_sampling import DynamicSampling
from lightning_vlm.methods.online_metrics import (
    EXTREMES,
    MissingRewardWarning,
    log_synced,
    pooled_correction,
    rollout_metrics,
    stat_weights,
    step_value,
)
from lightning_vlm.methods.online_sampling import RolloutSampling
from lightning_vlm.methods.reference_state import KeepsReference
from lightning_vlm.methods.rollout_buffer import RolloutBatch, Step, check_rollout_counts, global_counts
from lightning_vlm.methods.skipped_steps import step_holding_schedule
from lightning_vlm.methods.step_layout import rank_chunks
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import Shard
from lightning_vlm.parallel.steps import (
    RootCalls,
    check_micro_batches,
    engine_clipping,
    no_backward_sync,
    root_forward,
)
from lightning_vlm.rewards.routing import device_rewards
from lightning_vlm.rewards.scoring import RewardScorer

log = logging.getLogger(__name__)
# In checkpoints: whether trainer.max_steps stopped the last generation before its last optimizer step.
_CUT_KEY = "lightning_vlm/generation_cut"


class OnlineRL(KeepsReference, RootCalls, RolloutSampling):
    """Base of GRPO, RLOO and Online DPO: subclasses give ``compute_advantages`` and ``loss``."""

    data_shape: ClassVar[str] = "prompt"  # the rows it samples from (data=prompt)

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
        beta: float = 0.0,
        mask_truncated_completions: bool = False,
        max_grad_norm: float | None = 1.0,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "sequence_mask",
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_importance_sampling_clip_min: float | None = None,
        val_num_generations: int = 4,
        val_seed: int = 1234,
        seed: int | None = 0,
        dynamic_sampling: DynamicSampling | Mapping[str, Any] | None = None,
        disable_dropout: bool = False,
    ) -> None:
        super().__init__()
        # Only plain values in hparams: checkpoints then load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["vlm", "reward_model", "optimizer", "scheduler", "sampling",
                                          "reward_funcs", "dynamic_sampling"])  # fmt: skip
        self.automatic_optimization = False
        # Kept as attributes too: hparams drop what cannot be pickled (a lambda optimizer factory).
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        sampling = SamplingSettings.of(sampling, max_completion_length)
        if sampling.greedy:  # the configs are checked by settings_check; this is for Python users
            raise ValueError(
                "online training samples: set sampling.do_sample=true and sampling.temperature > 0"
            )
        check_rollout_counts(num_generations, num_iterations, steps_per_generation, micro_batch_size, beta)
        self.is_level, self.is_mode = split_trl_mode(vllm_importance_sampling_mode)
        check_clip_bounds(vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max, self.is_mode)
        self.vlm, self.sampling = vlm, sampling
        self.dynamic_sampling = DynamicSampling.of(dynamic_sampling)  # type: ignore[arg-type]
        self.completions_generated = 0  # over all ranks, checkpointed (online_sampling)
        self._generation_cut = False  # the last generation stopped by max_steps before its last step
        functions = list(reward_funcs) + ([reward_model] if reward_model is not None else [])
        self.scorer = RewardScorer(functions, reward_weights)
        self.hparams.update(sampling=asdict(sampling), reward_funcs=list(self.scorer.names),
                            reward_weights=self.scorer.weights.tolist(),
                            dynamic_sampling=self.dynamic_sampling.describe())  # fmt: skip
        self.reward_model = reward_model
        # Replaceable by a callback (vLLM); HF generate samples from the training weights themselves.
        self.generator: Generator = HFGenerator(vlm)
        # TRL's disable_dropout: off for GRPO and RLOO, on for Online DPO (methods.common.turn_off_dropout)
        if disable_dropout:
            turn_off_dropout(vlm)
        self.ref: ReferenceModel | None = ReferenceModel(vlm) if self.needs_reference else None
        self.reference_fingerprint = self.ref.fingerprint if self.ref is not None else None  # run_identity.py
        self.val_reward, self.val_answer_accuracy = MeanMetric(), MeanMetric()
        self.val_rewards = torch.nn.ModuleDict({n: MeanMetric() for n in self.scorer.names})
        self.completion_recorder = CompletionRecorder()  # filled when LogCompletions asks
        self.missing_rewards = MissingRewardWarning()  # says when completions got no reward at all
        self._uneven_steps_warned = self._large_micro_batch_warned = False

    # ---- what subclasses decide ----------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """Reference log-probs are computed only for a KL term (beta > 0)."""
        return self.hparams.beta > 0

    @property
    def reads_old_logps(self) -> bool:
        """Whether the loss takes a ratio to the sampling policy (old log-probs); Online DPO's does not."""
        return True

    @property
    def policy_moves(self) -> bool:
        """Whether the policy can change between generation and a loss (then old log-probs are needed)."""
        return self.hparams.num_iterations > 1 or self.hparams.steps_per_generation > 1

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """Per-completion advantages [N] from ``batch.rewards`` (and old/ref log-probs if needed)."""
        raise NotImplementedError

    def loss(
        self, batch: RolloutBatch, index: torch.Tensor, step: Step, logps: torch.Tensor,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """Loss of micro-batch ``index`` within optimizer ``step``, normalised over the whole step (all
        ranks' part of it: divide sums by ``step.counts``)."""
        raise NotImplementedError

    # ---- the loop ----------------------------------------------------------------------------------------
    def training_step(self, rows: list[dict], batch_idx: int) -> None:
        hp = self.hparams
        # 1-2. Sample G completions per prompt with the current weights and score them (None rewards stay
        #    NaN: out of group statistics, advantage 0); with dynamic sampling, in rounds until enough
        #    groups pass the filter. Each rank samples all G of its own prompts (a group never spans
        #    ranks), seeded from (seed, global_step, rank, round): a resume redraws the same rollouts.
        rollouts, per_function = self.sample(rows)
        batch = RolloutBatch.build(
            self.vlm, rollouts, per_function, self.scorer.total(per_function), hp.mask_truncated_completions
        ).to(self.device)
        n = len(batch)
        batch.shard = Shard.exchange(n, self.device)
        # 3. Log-probs frozen at generation time: old (the policy will move, or another engine sampled), ref (KL).
        correct = hp.vllm_importance_sampling_correction and not self.sampler_is_policy(rollouts)
        if correct and batch.sampler_logps is None:
            raise ValueError("vllm_importance_sampling_correction needs the generator's per-token logprobs")
        if (self.policy_moves and self.reads_old_logps) or correct:
            batch.old_logps = self.frozen_logps(batch, reference=False)
        if self.needs_reference:
            batch.ref_logps = self.frozen_logps(batch, reference=True)
        if correct:
            batch.is_weights, is_metrics = rollout_correction(
                batch.old_logps, batch.sampler_logps, batch.completion_mask, self.is_level, self.is_mode,
                hp.vllm_importance_sampling_clip_max, hp.vllm_importance_sampling_clip_min,
            )  # fmt: skip
            pooled = pooled_correction(is_metrics, batch.completion_mask, self.is_level)
            self.log_dict({f"train/{k}": v for k, v in pooled.items()}, batch_size=len(rows))
        # 4. Advantages, once per generation (over all ranks' completions where TRL takes the whole batch).
        batch.advantages = self.compute_advantages(batch)
        self.log_rollouts(batch)
        if self.completion_recorder.wants("train"):
            self.completion_recorder.record("train", rollout_samples(batch, self.scorer.names))
        # 5. num_iterations passes over steps_per_generation optimizer steps. Every loss divides by
        #    normalisers of its whole optimizer step over all ranks, so neither micro-batching nor the
        #    number of processes changes the update.
        # An epoch's short last batch may not split into steps_per_generation equal steps: its steps
        # differ by one unit, and every rank runs the same optimizer steps, and the same micro-batches
        # in each (step_layout: a rank short of rows must not leave the others in a collective).
        unit = self.step_unit
        chunks = rank_chunks(
            batch.shard.sizes, batch.shard.rank, hp.steps_per_generation, hp.micro_batch_size, unit
        )
        self._warn_uneven_steps(batch.shard, unit, chunks)
        check_micro_batches(self, chunks)
        counts = global_counts(
            [self.step_counts(batch, torch.cat(c).to(self.device)) for c in chunks], batch.shard.world_size
        )
        opt, sched = self.optimizers(), self.lr_schedulers()
        metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        # trainer.max_steps counts optimizer steps (TRL's too): stop at it, within a generation if need be.
        steps = [pair for _ in range(hp.num_iterations) for pair in zip(chunks, counts, strict=True)]
        planned = len(steps)
        if self.trainer.max_steps >= 0:
            steps = steps[: max(self.trainer.max_steps - self.trainer.global_step, 1)]
        self._generation_cut = len(steps) < planned
        for micro_batches, step_counts in steps:
            step = Step(torch.cat(micro_batches).to(self.device), step_counts)
            opt.zero_grad()
            step_metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
            weights = stat_weights(batch.completion_mask, micro_batches)
            for j, index in enumerate(micro_batches):
                # Gradients are all-reduced once per optimizer step, on its last micro-batch.
                sync = j == len(micro_batches) - 1
                with contextlib.nullcontext() if sync else no_backward_sync(self):
                    loss, stats = root_forward(
                        self, self._micro_batch_loss, batch, index.to(self.device), step
                    )
                    self.manual_backward(loss)
                step_metrics["loss"].append(loss.detach())
                for k, v in stats.items():
                    # Detached: kept with its graph (the entropy's), a stat held [tokens, vocabulary] tensors
                    v = v.detach()
                    step_metrics[k].append(v if k.endswith(EXTREMES) else v * weights[j])
            # One value per step (its micro-batches' weighted terms summed); extremes keep every value.
            for k, values in step_metrics.items():
                metrics[k] += values if k.endswith(EXTREMES) else [torch.stack(values).sum()]
            step_holding_schedule(self.trainer, opt, sched)  # clips in on_before_optimizer_step
            self.on_policy_update()
        # Loss terms add up over a step's micro-batches; the stats were weighted to a mean per step. Each
        # rank's loss is its share of the step's loss: the mean over ranks is the step's loss.
        values = {f"train/{k}": step_value(k, v) for k, v in metrics.items()}
        log_synced(self, {**values, "train/timing/step_s": self.step_seconds()}, len(rows))

    def _micro_batch_loss(
        self, batch: RolloutBatch, index: torch.Tensor, step: Step
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = batch.inputs(index, self.vlm.config)
        logps, entropy = self.vlm.token_logps(
            inputs, inputs["completion_mask"].bool(), self.logps_temperature,
            return_entropy=True, mask_suppressed=True,
        )  # fmt: skip
        w = batch.prompt_width
        loss, stats = self.loss(batch, index, step, logps[:, w:], entropy[:, w:])
        # Mean entropy of the completion tokens: the same for every method, so logged here.
        mask = batch.completion_mask[index].to(entropy.dtype)
        stats["entropy"] = (entropy[:, w:] * mask).sum() / mask.sum().clamp(min=1)
        return loss, stats

    @property
    def logps_temperature(self) -> float:
        """The temperature of the loss's log-probs: the sampling one, so the policy-gradient ratios are
        those of the distribution the completions were drawn from (TRL's GRPO and RLOO divide too)."""
        return self.sampling.temperature

    @property
    def step_unit(self) -> int:
        """Completions that must share a micro-batch (and an optimizer step): 1; Online DPO's pair: 2."""
        return 1

    def _warn_uneven_steps(self, shard: Shard, unit: int, chunks: list[list[torch.Tensor]]) -> None:
        # Each said once: expected at an epoch's end; on every batch, the settings do not split evenly.
        hp, n = self.hparams, shard.sizes[shard.rank]
        if (n // unit) % hp.steps_per_generation and not self._uneven_steps_warned and self.global_rank == 0:
            self._uneven_steps_warned = True
            log.warning(
                f"{n} completions (prompts × num_generations) do not split into steps_per_generation="
                f"{hp.steps_per_generation} equal optimizer steps: they train in {len(chunks)} steps of "
                f"{sorted({len(torch.cat(c)) for c in chunks}, reverse=True)} completions (an epoch's "
                "short last batch does this; if every batch does, change the batch size or the setting)"
            )
        size = hp.micro_batch_size
        largest = max(len(m) for step in chunks for m in step)
        if size is not None and largest > max(size, unit) and not self._large_micro_batch_warned:
            # Any rank: it is the rank holding more completions than the others that says so.
            self._large_micro_batch_warned = True
            log.warning(
                f"rank {shard.rank}: micro-batches of up to {largest} completions, over micro_batch_size="
                f"{size}: the ranks hold {list(shard.sizes)} completions (rows skipped under "
                "data.on_bad_row=skip shorten a rank's batch), and every rank must run as many forward "
                "passes as the shortest one can"
            )

    def step_counts(self, batch: RolloutBatch, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's counts in one optimizer step that the loss normalises by (``Step.counts``)."""
        return {
            "tokens": batch.completion_mask[index].sum(),
            "sequences": torch.tensor(len(index), device=index.device),
        }

    def on_policy_update(self) -> None:
        """Called after every optimizer step: the policy's weights changed (hook for weight syncing)."""

    def frozen_logps(self, batch: RolloutBatch, reference: bool) -> torch.Tensor:
        """Per-token log-probs [N, T] of the completions under the current (or reference) weights."""
        model = self.ref if reference else self.vlm
        # As many forwards on every rank (step_layout), each of at most micro_batch_size completions.
        passes = rank_chunks(batch.shard.sizes, batch.shard.rank, 1, self.hparams.micro_batch_size)[0]
        return batch.frozen_logps(model, self.vlm.config, passes, self.logps_temperature)

    # ---- metrics -------------------------------------------------------------------------------------------
    def log_rollouts(self, batch: RolloutBatch) -> None:
        """Per-generation metrics over every rank's completions (the same values on every rank)."""
        n_prompts = len(batch.rollouts.rows)
        values = rollout_metrics(batch, self.hparams.num_generations, list(self.scorer.names))
        self.missing_rewards.check(values, list(self.scorer.names), self.trainer.global_step)
        self.log_dict({f"train/{k}": v for k, v in values.items()}, batch_size=n_prompts)
        self.log("train/reward_step", values["reward"], prog_bar=True, batch_size=n_prompts, logger=False)

    # ---- validation ----------------------------------------------------------------------------------------
    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        hp = self.hparams
        # Fixed seeds per batch, in a forked RNG: the same rollouts before and after training, and the
        # training RNG (hence resume) untouched by validation.
        references = [r.get("solution") for r in rows]  # a list of strings: accepted answers
        with seeded(self.generator, hp.val_seed + batch_idx, self.device):
            _, hits = greedy_answer_hits(self.generator, rows, references, self.sampling.max_new_tokens)
            sampled = self.generator.generate(rows, hp.val_num_generations, self.sampling)
        # Metrics are updated (possibly with nothing) and logged by every rank alike: their sync at epoch
        # end is a collective, which a rank that skipped it would leave hanging. Whether any row has a
        # ``solution`` is decided over ranks (rows of a mixed file may lack it, the first one included).
        if self.trainer.strategy.reduce_boolean_decision(bool(hits), all=False):
            self.val_answer_accuracy.update(torch.tensor(hits, device=self.device))
            self.log("val/answer_accuracy", self.val_answer_accuracy, prog_bar=True, batch_size=len(rows))
        per_function, names = self.score(sampled)
        total = self.scorer.total(per_function)
        self.val_reward.update(total[~total.isnan()].to(self.device))
        self.log("val/reward", self.val_reward, prog_bar=True, batch_size=len(rows))
        for j, name in enumerate(names):
            column = per_function[:, j]
            self.val_rewards[name].update(column[~column.isnan()].to(self.device))
            self.log(f"val/rewards/{name}", self.val_rewards[name], batch_size=len(rows))

    # ---- setup, checkpointing, optimizers --------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Before the strategy builds its engine: DeepSpeed clips there (``max_grad_norm``)."""
        engine_clipping(self, self.hparams.max_grad_norm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[_CUT_KEY] = self._generation_cut

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._generation_cut = bool(checkpoint.get(_CUT_KEY, False))

    def on_train_start(self) -> None:
        # Rollouts are not checkpointed (TRL regenerates after a resume too), so the rest of a generation that
        # max_steps cut short is never trained, and the resumed run is not the uninterrupted one.
        if self._generation_cut and self.global_rank == 0:
            log.warning(
                "this run resumes from step %d, where trainer.max_steps ended a generation before its last "
                "optimizer step: the rest of that generation is not trained (its rollouts are not saved), so "
                "the run continues with a new generation and will not match one run straight through",
                self.trainer.global_step,
            )

    def on_fit_start(self) -> None:
        # Frozen helpers are not submodules (not trained, not checkpointed): move them by hand.
        if self.ref is not None:
            self.ref.to(self.device)
        # Reward models wherever they are: the reward_model slot, reward_funcs, or routed by a TaskReward.
        for reward in device_rewards(self.scorer.functions):
            reward.to(self.device)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self, self.optimizer_factory, self.scheduler_factory)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Here, not before opt.step(): under fp16 AMP the precision plugin unscales the gradients
        # between the two, and a clip of scaled gradients shrinks the update by the loss scale.
        clip_gradients(self, optimizer, self.hparams.max_grad_norm)
