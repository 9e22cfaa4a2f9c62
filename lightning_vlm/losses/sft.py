"""Supervised fine-tuning loss: negative log-likelihood of the target (assistant) tokens."""

from __future__ import annotations

import torch

from lightning_vlm.losses.normalizers import divisor


def sft_loss(
    token_logps: torch.Tensor, mask: torch.Tensor, num_items_in_batch: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean NLL over all target tokens of the batch: -Σ mask·logp / Σ mask.

    Token-level mean (as TRL's SFT and HF's causal-LM loss), so long answers weigh more than short
    ones. ``num_items_in_batch`` replaces the local Σ mask (TRL's name): under data parallelism and
    gradient accumulation the token count of the optimizer step's micro-batches on all ranks divided by
    the world size, so that DDP's gradient average is the mean over every rank's tokens of the step. An all-zero mask gives 0 (not NaN), so an empty batch cannot poison the
    weights. A count of all ranks below 1 per rank (1 token on 2 ranks: 0.5) is kept as it is.
    """
    mask = mask.to(token_logps.dtype)
    tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
    return -(token_logps * mask).sum() / divisor(tokens, token_logps)


def token_accuracy(
    predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of correct target tokens, number of target tokens) for a weighted mean across steps."""
    mask = mask.bool()
    return ((predictions == targets) & mask).sum(), mask.sum()
