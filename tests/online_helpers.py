"""Helpers of the online-RL tests: fixed rollouts, a tiny trainer, one training step."""

from __future__ import annotations

import copy
import functools

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_vlm.data.datamodule import collate_rows
from lightning_vlm.generation.base import OwnWeightsGenerator, Rollouts, SamplingSettings
from lightning_vlm.generation.hf import HFGenerator


class FixedGenerator(OwnWeightsGenerator):
    """Returns the same rollouts every call (so two runs see identical samples); seeds change nothing."""

    def __init__(self, rollouts: Rollouts, is_policy: bool = True) -> None:
        self.rollouts = rollouts
        self.is_policy = is_policy
        self.calls = 0

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        self.calls += 1
        assert num_generations == self.rollouts.num_generations
        return copy.copy(self.rollouts)


def sample_rollouts(vlm, rows: list[dict], num_generations: int, max_new_tokens: int = 6, seed: int = 0):
    """Rollouts sampled once with HF generate at temperature 1."""
    torch.manual_seed(seed)
    return HFGenerator(vlm).generate(rows, num_generations, SamplingSettings(max_new_tokens=max_new_tokens))


def token_reward_fn(completions, completion_ids, **kwargs):
    """A reward that varies inside groups even when every completion has the same length."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def tie_marked_reward_fn(completions, completion_ids, tie, **kwargs):
    """:func:`token_reward_fn`, but 0 for every completion of rows whose ``tie`` column is true (their
    groups tie, so dynamic sampling filters them)."""
    return [0.0 if t else float(sum(ids) % 7) for ids, t in zip(completion_ids, tie, strict=True)]


def first_token_reward_fn(completions, completion_ids, **kwargs):
    """A second reward, on another scale than :func:`token_reward_fn` (GDPO normalises each on its own)."""
    return [float(ids[0] % 3) * 10.0 if ids else None for ids in completion_ids]


def fit_steps(module: L.LightningModule, rows: list[dict], steps: int = 1, **trainer_kwargs) -> L.Trainer:
    """Run ``steps`` optimizer steps of ``module`` on ``rows`` (one batch = all rows), CPU, no logging."""
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, **trainer_kwargs,
    )  # fmt: skip
    loader = DataLoader(rows, batch_size=len(rows), collate_fn=collate_rows)
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def sgd(lr: float = 1.0):
    """A partial optimizer whose update is linear in the gradient (exact comparisons)."""
    return functools.partial(torch.optim.SGD, lr=lr)
