"""One generation's rollouts as tensors: encoded once, sliced into micro-batches for the optimizer steps.

Prompts are encoded once per generation (one processor call for the P prompts and their images);
a micro-batch of completions then selects its prompts' token rows and image extras by index, so
the G completions of a prompt reuse the same processed pixels instead of re-running the processor.
Each micro-batch carries ``image_groups`` (its rows' prompt), so the vision tower runs once per
prompt image per forward (``models/vision_cache.py``), not once per completion.
Completions are right-padded to the longest one of the generation, so per-token tensors of every
micro-batch (old/ref/sampler log-probs, masks) are plain row slices of [N, T] tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_vlm.generation.base import Rollouts
from lightning_vlm.models.encoding import TYPE_ID_KEYS, pad_completions
from lightning_vlm.models.image_tokens import NUM_IMAGES_KEY, merge_image_inputs, split_image_inputs
from lightning_vlm.models.vision_cache import with_image_groups
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import Shard, all_reduce_sum

PROMPT_TOKEN_KEYS = ("input_ids", "attention_mask", *TYPE_ID_KEYS, NUM_IMAGES_KEY)


@dataclass
class RolloutBatch:
    """Encoded prompts, padded completions and the per-completion quantities the losses read."""

    rollouts: Rollouts
    prompt_inputs: dict
    prompt_images: list[dict]
    prompt_index: torch.Tensor
    completion_ids: torch.Tensor
    token_mask: torch.Tensor
    completion_mask: torch.Tensor
    pad_id: int
    rewards: torch.Tensor
    per_function: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    # Where these completions sit among all ranks' (set by the loop): statistics TRL takes over the
    # whole generation batch (batch std, logged means) are taken over every rank's completions.
    shard: Shard | None = None
    extras: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        vlm: VLM,
        rollouts: Rollouts,
        per_function: torch.Tensor,
        rewards: torch.Tensor,
        mask_truncated: bool = False,
    ) -> RolloutBatch:
        """Encode the prompts once and pad the completions; truncated ones are masked out if asked."""
        rows = rollouts.rows
        prompt_inputs = vlm.encode_prompts([r["prompt"] for r in rows], [r.get("images", []) for r in rows])
        prompt_images = split_image_inputs(prompt_inputs, vlm.config)
        ids, tokens = pad_completions(rollouts.completion_ids, vlm.pad_token_id)
        mask = tokens
        if mask_truncated:
            # TRL's mask_truncated_completions: an unfinished answer is no evidence either way.
            truncated = torch.tensor(rollouts.truncated, dtype=torch.bool)
            mask = mask.masked_fill(truncated.unsqueeze(-1), 0)
        sampler = None
        if rollouts.logprobs is not None and all(
            len(lp) == len(c) for lp, c in zip(rollouts.logprobs, rollouts.completion_ids, strict=True)
        ):
            sampler, _ = pad_completions([[0] * len(c) for c in rollouts.completion_ids], 0)
            sampler = sampler.float()
            for i, lp in enumerate(rollouts.logprobs):
                sampler[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return cls(
            rollouts=rollouts,
            prompt_inputs={k: v for k, v in prompt_inputs.items() if k in PROMPT_TOKEN_KEYS},
            prompt_images=prompt_images,
            prompt_index=torch.tensor(rollouts.prompt_index, dtype=torch.long),
            completion_ids=ids,
            token_mask=tokens,
            completion_mask=mask,
            pad_id=vlm.pad_token_id,
            rewards=rewards,
            per_function=per_function,
            sampler_logps=sampler,
        )

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Move every tensor (prompt tensors and image extras included) to ``device``."""

        def move(value):
            return value.to(device) if torch.is_tensor(value) else value

        for name in ("prompt_index", "completion_ids", "token_mask", "completion_mask", "rewards", "per_function",
                     "advantages", "old_logps", "ref_logps", "sampler_logps", "is_weights"):  # fmt: skip
            setattr(self, name, move(getattr(self, name)))
        self.prompt_inputs = {k: move(v) for k, v in self.prompt_inputs.items()}
        self.prompt_images = [{k: move(v) for k, v in d.items()} for d in self.prompt_images]
        return self

    def inputs(self, index: torch.Tensor, config) -> dict:
        """Model inputs (prompt + completion, with ``completion_mask``) for the completions in ``index``."""
        prompts = self.prompt_index[index]
        out = merge_image_inputs([self.prompt_images[int(p)] for p in prompts], config)
        for key, value in self.prompt_inputs.items():
            out[key] = value[prompts]
        completion_ids = self.completion_ids[index]
        # Masked (truncated) completions still attend over all their tokens; only the loss mask drops them.
        real = self.token_mask[index]
        prompt_ids, prompt_mask = out.pop("input_ids"), out.pop("attention_mask")
        out["input_ids"] = torch.cat([prompt_ids, completion_ids], dim=1)
        out["attention_mask"] = torch.cat([prompt_mask, real.to(prompt_mask.dtype)], dim=1)
        for key in TYPE_ID_KEYS:
            if key in out:
                out[key] = torch.cat([out[key], torch.zeros_like(completion_ids)], dim=1)
        loss_mask = self.completion_mask[index].to(prompt_mask.dtype)
        out["completion_mask"] = torch.cat([torch.zeros_like(prompt_mask), loss_mask], dim=1)
        # Completions of one prompt share its images: one vision pass per prompt, not per completion.
        return with_image_groups(out, prompts.cpu())

    @property
    def prompt_width(self) -> int:
        """Columns of the (left-padded) prompt part of every micro-batch's inputs."""
        return self.prompt_inputs["input_ids"].shape[1]

    @torch.no_grad()
    def frozen_logps(
        self, model: Any, config: Any, passes: list[torch.Tensor], temperature: float
    ) -> torch.Tensor:
        """Per-token log-probs [N, T] of the completions under ``model`` (the policy or its reference, a
        ``token_logps`` owner), one forward per index tensor of ``passes`` (consecutive, covering all N);
        frozen: no gradient."""
        out = []
        for index in passes:
            inputs = self.inputs(index.to(self.completion_mask.device), config)
            mask = inputs["completion_mask"].bool()
            logps, _ = model.token_logps(inputs, mask, temperature, mask_suppressed=True)
            out.append(logps[:, self.prompt_width :])
        return torch.cat(out)


@dataclass
class Step:
    """One optimizer step: this rank's completions in it and the step's normalisers over all ranks.

    ``counts`` maps a name ("tokens": active completion tokens, "sequences", or a method's own) to its
    sum over every rank's part of the step divided by the world size: a rank dividing its loss *sum*
    by it makes DDP's gradient average the one-process update (see ``parallel.mean_normalizer``).
    """

    index: torch.Tensor
    counts: dict[str, torch.Tensor]

    @property
    def tokens(self) -> torch.Tensor:
        return self.counts["tokens"]

    @property
    def sequences(self) -> torch.Tensor:
        return self.counts["sequences"]


def global_counts(local: list[dict[str, torch.Tensor]], world_size: int) -> list[dict[str, torch.Tensor]]:
    """Per-step local counts -> Σ over ranks / world size, in one collective for every step and name.

    A count of zero becomes 1 / world size: its loss sum is zero too, and any non-zero total is at
    least that, so the floor only avoids 0/0 (on one process it is the usual clamp at 1).
    """
    names = list(local[0])
    stacked = torch.stack([torch.stack([c[k].float() for k in names]) for c in local])
    reduced = (all_reduce_sum(stacked) / world_size).clamp(min=1.0 / world_size)
    return [dict(zip(names, row, strict=True)) for row in reduced]


def check_rollout_counts(
    num_generations: int, num_iterations: int, steps_per_generation: int, micro_batch_size: int | None,
    beta: float,
) -> None:  # fmt: skip
    """Refuse counts the loop cannot run (an error naming the setting), before any model work."""
    for name, value in (("num_generations", num_generations), ("num_iterations", num_iterations),
                        ("steps_per_generation", steps_per_generation)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")


def reward_columns(rollouts: Rollouts) -> dict[str, list]:
    """What reward functions get besides the completions: every row column, one entry per completion,
    with the chat ``prompts`` and the ``completion_ids``."""
    rows = [rollouts.rows[i] for i in rollouts.prompt_index]
    # Every row's keys, in first-seen order: rows of a mixed file keep their own keys, so the first row
    # may lack a column (``solution`` on a caption row) that later rows carry.
    keys = dict.fromkeys(key for row in rollouts.rows for key in row if key != "prompt")
    columns = {key: [row.get(key) for row in rows] for key in keys}
    columns.update(prompts=[row["prompt"] for row in rows], completion_ids=rollouts.completion_ids)
    return columns
