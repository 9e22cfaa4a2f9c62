"""The sampling half of the online loop: seeds, generation rounds (dynamic sampling), scoring, counts.

Mixed into :class:`~lightning_vlm.methods.online.OnlineRL`, which owns the attributes read here
(``generator``, ``sampling``, ``scorer``, ``dynamic_sampling``). Every generation round is seeded from
(seed, global_step, rank, round), so a resumed run redraws what the uninterrupted one drew; the
number of completions generated so far (over all ranks) travels in the checkpoint, so a resumed
run's count continues too (the dynamic-sampling benchmark compares these counts).
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch

from lightning_vlm.generation.base import Generator, Rollouts, SamplingSettings, seeded
from lightning_vlm.methods.dynamic_sampling import DynamicSampling, collect
from lightning_vlm.methods.online_metrics import log_synced
from lightning_vlm.methods.rollout_buffer import reward_columns
from lightning_vlm.parallel.collectives import all_reduce_sum
from lightning_vlm.rewards.scoring import RewardScorer, TrainerState

# Seed offset between generation rounds of one step: far beyond any step count, so no two
# (step, rank, round) share a seed, and round 0 keeps the seed of runs without dynamic sampling.
_ROUND_STRIDE = 1_000_000_007
_COUNTER_KEY = "lightning_vlm/completions_generated"


class RolloutSampling(L.LightningModule):
    """Generation for the online methods: ``sample(pool)`` -> the step's rollouts and [N, F] rewards."""

    generator: Generator
    sampling: SamplingSettings
    scorer: RewardScorer
    dynamic_sampling: DynamicSampling
    completions_generated: int
    _batch_started: float = 0.0  # set by on_train_batch_start; a class default keeps step_seconds callable

    def sample(self, pool: list[dict]) -> tuple[Rollouts, torch.Tensor]:
        """Completions for the step's prompt ``pool`` (all of it, or DAPO's filtered rounds) and their rewards."""

        def generate(rows: list[dict], round_index: int) -> Rollouts:
            with seeded(self.generator, self.rollout_seed(round_index), self.device):
                return self.generator.generate(rows, self.samples_per_prompt, self.sampling)

        def everyone_done(done: bool) -> bool:
            # A collective: all ranks run the same rounds (FSDP's generation forwards must match).
            return all_reduce_sum(torch.tensor(float(not done), device=self.device)).item() == 0

        start = time.perf_counter()
        rollouts, per_function, counts = collect(
            pool, self.dynamic_sampling, generate, lambda r: self.score(r)[0], self.train_rewards,
            everyone_done, self.in_loss,
        )  # fmt: skip
        seconds = time.perf_counter() - start  # the completions are on the host by now: nothing in flight
        counts.setdefault("generated", float(len(rollouts)))
        # Counts of every rank together, in one all-reduce; rounds are the same on every rank. float32
        # (MPS has none wider) holds whole numbers exactly up to 2^24, far above a step's counts.
        rounds = counts.pop("rounds", None)
        totals = all_reduce_sum(torch.tensor(list(counts.values()), dtype=torch.float32, device=self.device))
        counts = dict(zip(counts, totals.tolist(), strict=True))
        self.completions_generated += int(counts["generated"])
        values = {}
        if self.dynamic_sampling.enabled:
            values = {f"train/dynamic_sampling/{k}": torch.tensor(v) for k, v in counts.items()}
            values["train/dynamic_sampling/rounds"] = torch.tensor(rounds)
        values["train/completions_generated"] = torch.tensor(float(self.completions_generated))
        # Wall time of the generation rounds with their scoring (verl's timing_s/gen), mean over ranks;
        # against train/timing/step_s, what generation costs.
        values["train/timing/rollout_s"] = torch.tensor(seconds)
        # Every rank logs the same (global) values: the mean over ranks leaves them as they are.
        log_synced(self, values, len(pool))
        return rollouts, per_function

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Starts ``step_seconds``'s clock. A module's hook runs after the callbacks' hooks: the vLLM weight
        push before the generation is not counted (it has ``train/vllm_sync_seconds``)."""
        self._batch_started = time.perf_counter()

    def step_seconds(self) -> torch.Tensor:
        """``train/timing/step_s`` (verl's ``timing_s/step``): the wall time of this batch's generation and
        every optimizer step it feeds, taken by ``training_step`` itself, so the callbacks' batch-end work
        (a checkpoint save, W&B tables) is not counted."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels are part of its time
        return torch.tensor(time.perf_counter() - self._batch_started)

    def train_rewards(self, rollouts: Rollouts, per_function: torch.Tensor) -> torch.Tensor:
        """The [N] rewards the loss trains on, as far as they are known at sampling time (dynamic
        sampling filters on them): the weighted sum of the reward functions."""
        return self.scorer.total(per_function)

    def in_loss(self, rollouts: Rollouts) -> list[bool]:
        """Which completions the loss keeps (a group with none cannot teach): under
        ``mask_truncated_completions`` (TRL's), the finished ones."""
        if self.hparams.mask_truncated_completions:
            return [not t for t in rollouts.truncated]
        return [True] * len(rollouts)

    @property
    def samples_per_prompt(self) -> int:
        """Completions generated per prompt (Online DPO may draw more candidates than it keeps)."""
        return self.hparams.num_generations

    def rollout_seed(self, round_index: int = 0) -> int | None:
        """The sampling seed of a generation round: (seed, global_step, rank, round); rank 0 of one
        process keeps the single-process value."""
        seed, trainer = self.hparams.seed, self.trainer
        if seed is None:
            return None
        base = (seed * 1_000_003 + trainer.global_step) * trainer.world_size + trainer.global_rank
        return base + round_index * _ROUND_STRIDE

    def sampler_is_policy(self, rollouts: Rollouts) -> bool:
        """Sampled from the training weights themselves (no IS correction): as the rollouts or generator say."""
        return bool(rollouts.extras.get("is_policy", self.generator.is_policy))

    def score(self, rollouts: Rollouts) -> tuple[torch.Tensor, list[str]]:
        """[N, F] rewards (NaN for None); each function gets the completions as TRL passes them for
        conversational prompts (VLM prompts always are: one assistant message each), every row column,
        TRL's ``trainer_state`` and the chat template's ``generation_prompt`` (what precedes every
        completion, e.g. a prefilled ``<think>``)."""
        columns = {**reward_columns(rollouts), "generation_prompt": self.vlm.generation_prompt,
                   "trainer_state": self._trainer_state()}  # fmt: skip
        completions = [[{"role": "assistant", "content": text}] for text in rollouts.completion_texts]
        return self.scorer(completions, columns)

    def _trainer_state(self) -> TrainerState:
        """TRL's ``trainer_state`` values: the optimizer step, the epoch with its fraction done, and the
        run's length in optimizer steps (by epochs: batches x epochs x steps per batch; -1 if unbounded)."""
        trainer = self._trainer  # None outside fit (scoring rollouts by hand): step 0 of no set length
        if trainer is None:
            return TrainerState(0, 0.0, -1)
        batches = trainer.num_training_batches
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1  # batches before this one
        epoch = trainer.current_epoch + (done / batches if 0 < batches < math.inf else 0.0)
        steps = trainer.max_steps
        if steps < 0:
            total = trainer.estimated_stepping_batches  # batches x epochs: one generation each
            per_batch = self.hparams.steps_per_generation * self.hparams.num_iterations
            steps = int(total * per_batch) if total < math.inf else -1
        return TrainerState(trainer.global_step, epoch, steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[_COUNTER_KEY] = self.completions_generated

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.completions_generated = int(checkpoint.get(_COUNTER_KEY, 0))
