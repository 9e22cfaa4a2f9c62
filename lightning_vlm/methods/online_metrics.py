"""What online methods log per generation, over every rank's completions, and how loss stats are synced.

TRL reports reward and advantage statistics over the whole generation batch (it gathers them from
all processes); so do we: each rank's per-completion values are gathered once per generation, and
every rank computes the same numbers from them.
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_vlm.methods.rollout_buffer import RolloutBatch


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std over non-NaN entries (0 with fewer than two)."""
    valid = x[~x.isnan()]
    return valid.std() if valid.numel() > 1 else x.new_zeros(())


def rollout_metrics(
    batch: RolloutBatch, num_generations: int, reward_names: list[str]
) -> dict[str, torch.Tensor]:
    """Rewards per function, advantages, completion lengths and truncation of the whole generation batch."""
    local = torch.stack(
        [
            batch.rewards.float(),
            batch.advantages.float(),
            batch.token_mask.sum(-1).float(),
            torch.tensor(batch.rollouts.truncated, dtype=torch.float, device=batch.rewards.device),
            *batch.per_function.float().T,
        ],
        dim=1,
    )
    # One collective for every column; groups of G stay whole (a rank holds all of a prompt's samples).
    columns = (batch.shard.gather(local) if batch.shard is not None else local).T
    rewards, advantages, lengths, truncated = columns[:4]
    grouped = rewards.view(-1, num_generations)
    values = {
        "reward": torch.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": (grouped.nan_to_num(-1e9).std(-1) == 0).float().mean()
        if num_generations > 1
        else torch.ones((), device=rewards.device),  # one sample per prompt: no spread to learn from
        "advantages/mean": advantages.mean(),
        "advantages/std": advantages.std() if len(advantages) > 1 else advantages.new_zeros(()),
        "advantages/abs_mean": advantages.abs().mean(),
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.mean(),
    }
    for name, column in zip(reward_names, columns[4:], strict=True):
        values[f"rewards/{name}/mean"] = torch.nanmean(column)
        values[f"rewards/{name}/std"] = nanstd(column)
    return values


def log_synced(module: L.LightningModule, values: dict[str, torch.Tensor], batch_size: int) -> None:
    """Log the mean over ranks of each value (the min / max for names ending in ``/min`` / ``/max``).

    Every rank must log the same names in the same order (each is a collective under DDP).
    """
    for reduce in ("min", "max", "mean"):
        part = {
            k: v for k, v in values.items() if (k.endswith(f"/{reduce}") if reduce != "mean" else
                                                 not k.endswith(("/min", "/max")))
        }  # fmt: skip
        if part:
            module.log_dict(part, batch_size=batch_size, sync_dist=True, reduce_fx=reduce)
