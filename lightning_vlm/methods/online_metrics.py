"""What online methods log per generation, over every rank's completions, and how loss stats are synced.

TRL reports reward and advantage statistics over the whole generation batch (it gathers them from
all processes); so do we: each rank's per-completion values are gathered once per generation, and
every rank computes the same numbers from them, in float64 (rewards near float32's limit would
overflow a float32 std to inf), logged in float32.

``frac_reward_none`` is the share of completions that no reward function scored (all None or NaN).
They get advantage 0, as in TRL; when that is the whole batch the policy loss is 0 and the run looks
healthy while learning nothing, typically because the functions miss a column they read
(``solution``) or do not recognise the completions' format. TRL warns "All reward functions returned
None for the following kwargs: ..." each time; ``MissingRewardWarning`` warns from global rank 0 at
the first such step, then at most once every ``every_n_steps`` steps with a count of the steps in
between, naming the functions that returned nothing for the whole batch.
"""

from __future__ import annotations

import logging
import math

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_vlm.losses.advantages import as_float64
from lightning_vlm.methods.rollout_buffer import RolloutBatch
from lightning_vlm.parallel.collectives import gather_cat, pooled_means

log = logging.getLogger(__name__)


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std over non-NaN entries (0 with fewer than two), computed in float64, in ``x``'s dtype."""
    valid = as_float64(x[~x.isnan()])
    return valid.std().to(x) if valid.numel() > 1 else x.new_zeros(())


def tied_groups(grouped: torch.Tensor) -> torch.Tensor:
    """Per group (a row of ``grouped``), whether its rewards carry no spread to learn from: fewer than two
    valid (non-None) rewards, or all valid ones equal. dynamic_sampling's ``zero_std`` filter drops exactly
    these groups. TRL's metric differs on a group whose rewards are all None (its std is NaN, not 0)."""
    valid = ~grouped.isnan()
    high = grouped.masked_fill(~valid, float("-inf")).amax(-1)
    low = grouped.masked_fill(~valid, float("inf")).amin(-1)
    return (valid.sum(-1) < 2) | (high == low)


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
    columns = as_float64(batch.shard.gather(local) if batch.shard is not None else local).T
    rewards, advantages, lengths, truncated = columns[:4]
    grouped = rewards.view(-1, num_generations)
    values = {
        "reward": torch.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_none": rewards.isnan().double().mean(),
        "frac_reward_zero_std": tied_groups(grouped).double().mean(),
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
    return {k: v.to(local.device, torch.float32) for k, v in values.items()}


EXTREMES = ("/min", "/max")
_CORRECTION_EXTREMES = ("is_ratio/min", "is_ratio/max", "sampler_logp_diff/max")


def pooled_correction(
    metrics: dict[str, torch.Tensor], mask: torch.Tensor, level: str
) -> dict[str, torch.Tensor]:
    """``rollout_correction``'s metrics of this rank's completions -> those over every rank's: what one
    process holding all of them computes (a mean over ranks' means would weigh a rank's few tokens as
    much as another's many, and a rank without rows, its values NaN, would spread NaN). The ratio's
    min / max are left out when no rank has a completion token. A collective: every rank calls it.
    """
    units = mask.bool().any(-1).sum() if level == "sequence" else mask.sum()
    out = pooled_means({k: metrics[k] for k in ("is_ratio/mean", "is_ratio/capped_frac")}, units)
    out |= pooled_means({"sampler_kl": metrics["sampler_kl"]}, mask.sum())
    extremes = gather_cat(torch.stack([metrics[k].float() for k in _CORRECTION_EXTREMES]).unsqueeze(0))
    for i, name in enumerate(_CORRECTION_EXTREMES):
        column = extremes[:, i][~extremes[:, i].isnan()]
        if column.numel():
            out[name] = column.min() if name.endswith("/min") else column.max()
    return out


def step_value(name: str, values: list[torch.Tensor]) -> torch.Tensor:
    """A statistic over a generation's optimizer steps: the extreme of its micro-batches' values
    for ``/min`` and ``/max`` names (NaN values, from micro-batches with nothing to describe, skipped; NaN
    if all are: a 0 would read as a ratio that collapsed), else the mean of its per-step values (one per
    step) over the steps that had something to describe (a step of Online DPO ties gives NaN: left out,
    not averaged in as 0; NaN if none had)."""
    stacked = torch.stack(values)
    if name == "loss":  # a diverged step's NaN shows, where a mean over the others hid it
        return stacked.mean()
    if not name.endswith(EXTREMES):
        described = ~stacked.isnan()
        return stacked[described].sum() / described.sum()
    described = stacked[~stacked.isnan()]
    if not described.numel():
        return torch.full((), math.nan, device=stacked.device)
    return described.min() if name.endswith("/min") else described.max()


def stat_weights(mask: torch.Tensor, micro_batches: list[torch.Tensor]) -> list[float]:
    """Each micro-batch's weight in its optimizer step's statistics: its share of the step's completions
    left in the loss (``mask``: [completions, tokens]). A micro-batch whose completions are all masked
    (``mask_truncated_completions``) has nothing to describe: weighted by its completions, its stats' 0
    read as ratio/mean 0.5 on policy and a halved entropy. NaN for a step with none left (``step_value``
    leaves the step out)."""
    active = (mask.sum(-1) > 0).cpu()
    counts = [int(active[index.cpu()].sum()) for index in micro_batches]
    total = sum(counts)
    return [c / total if total else math.nan for c in counts]


def log_synced(module: L.LightningModule, values: dict[str, torch.Tensor], batch_size: int) -> None:
    """Log the mean over ranks of each value, and for names ending in ``/min`` / ``/max`` the extreme over
    the ranks that had something to describe (NaN where none had: a reduce would take a rank's NaN as the
    extreme). Every rank must call it with the same names in the same order (collectives under DDP).
    """
    # on the module's device: NCCL cannot reduce a CPU tensor
    means = {k: v.to(module.device) for k, v in values.items() if not k.endswith(EXTREMES)}
    if means:
        module.log_dict(means, batch_size=batch_size, sync_dist=True, reduce_fx="mean")
    names = [k for k in values if k.endswith(EXTREMES)]
    if not names:
        return
    ranks = gather_cat(torch.stack([values[k].float().to(module.device) for k in names]).unsqueeze(0))
    for i, name in enumerate(names):
        column = ranks[:, i][~ranks[:, i].isnan()]
        low = name.endswith("/min")
        value = (column.min() if low else column.max()) if column.numel() else ranks.new_full((), math.nan)
        # the same on every rank already: no sync
        module.log(name, value, batch_size=batch_size, reduce_fx="min" if low else "max")


class MissingRewardWarning:
    """Warns (rank 0, rate-limited) from the rollout metrics when completions got no reward."""

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps
        self.last_warned: int | None = None  # global step of the last warning
        self.unwarned = 0  # steps with unscored completions since then, not yet reported

    def check(self, values: dict[str, torch.Tensor], names: list[str], step: int) -> bool:
        """Count and, when due, warn about this generation's unscored completions; True if it warned.

        ``values`` are ``rollout_metrics``' (the same on every rank): ``frac_reward_none`` and each
        function's ``rewards/<name>/mean``, NaN when it returned nothing for the whole batch.
        """
        fraction = float(values["frac_reward_none"])
        if not fraction > 0:
            return False
        self.unwarned += 1
        if self.last_warned is not None and step - self.last_warned < self.every_n_steps:
            return False
        silent = [n for n in names if math.isnan(float(values[f"rewards/{n}/mean"]))]
        since = "" if self.last_warned is None else f" since the warning at step {self.last_warned}"
        if rank_zero_only.rank == 0:
            whole = " (the whole batch: the step's policy loss is 0)" if fraction >= 1 else ""
            log.warning(
                "Step %d: every reward function returned None (or NaN) for %.0f%% of the completions%s; they "
                "get advantage 0 and add nothing to the loss. Reward functions that returned nothing for the "
                "whole batch: %s (of %s). Steps with unscored completions%s: %d. Check that each function "
                "finds the columns it reads (e.g. solution) and the completion format it expects; "
                "train/frac_reward_none logs the share per step (this warning repeats at most every %d steps).",
                step, 100 * fraction, whole, silent or "none", names, since, self.unwarned, self.every_n_steps,
            )  # fmt: skip
        self.last_warned, self.unwarned = step, 0
        return True
