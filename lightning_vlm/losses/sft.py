"""Supervised fine-tuning loss: negative log-likelihood of the target (assistant) tokens."""

from __future__ import annotations

import torch


def sft_loss(token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean NLL over all target tokens of the batch: -Σ mask·logp / Σ mask.

    Token-level mean (as TRL's SFT and HF's causal-LM loss), so long answers weigh more than short
    ones. An all-zero mask gives 0 (not NaN), so an empty batch cannot poison the weights.
    """
    mask = mask.to(token_logps.dtype)
    return -(token_logps * mask).sum() / mask.sum().clamp(min=1.0)


def token_accuracy(
    predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of correct target tokens, number of target tokens) for a weighted mean across steps."""
    mask = mask.bool()
    return ((predictions == targets) & mask).sum(), mask.sum()
