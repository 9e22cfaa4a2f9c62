"""Pieces every method shares: optimizer/scheduler wiring and turning conversations into prompts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch


def configure_optimizers(
    module: L.LightningModule,
    optimizer: Callable[..., torch.optim.Optimizer],
    scheduler: Callable[..., Any] | None = None,
) -> Any:
    """Completes the `_partial_` optimizer (and scheduler) nodes with the trainable parameters."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: is everything frozen (vision tower, LoRA settings)?")
    opt = optimizer(params=params)
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(optimizer=opt), "interval": "step"}}


def message_text(message: dict) -> str:
    """The concatenated text blocks of one chat message."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(block.get("text") or "" for block in content if block.get("type") == "text")


def answer_accuracy_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Splits SFT rows into prompt rows (all turns before the last assistant turn) and reference answers."""
    prompts, references = [], []
    for i, row in enumerate(rows):
        messages = row["messages"]
        last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError(f"row {i}: no assistant message to score against")
        prompts.append({**row, "prompt": messages[:last]})
        references.append(message_text(messages[last]))
    return prompts, references
