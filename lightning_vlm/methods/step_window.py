"""Step metrics over every micro-batch of an optimizer step (``trainer.accumulate_grad_batches``).

Lightning sends a step's ``on_step`` values to the logger once, after the step's last micro-batch, and
what it sends is the value that micro-batch logged. TRL averages its logged metrics over the
accumulated micro-batches. :class:`StepWindow` keeps weighted sums over the micro-batches that share a
``trainer.global_step`` (automatic optimisation steps once per window), so each micro-batch logs the
mean so far and the logger gets the whole step's. Without accumulation the values pass unchanged.
A checkpoint is written between optimizer steps, so a resumed run starts a fresh window.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class StepWindow:
    """Weighted means of one optimizer step's metrics over the micro-batches seen so far."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, float] = {}

    def update(
        self, step: int, values: Mapping[str, torch.Tensor], weights: Mapping[str, float] | float
    ) -> dict[str, torch.Tensor]:
        """Add one micro-batch's means ``values`` (each over ``weights[name]`` items, or ``weights`` for
        all) to optimizer step ``step``; return the step's means so far. A metric with no items yet (no
        weight, or NaN values only) is left out."""
        if step != self._step:
            self._step, self._sums, self._weights = step, {}, {}
        means = {}
        for name, value in values.items():
            weight = float(weights[name] if isinstance(weights, Mapping) else weights)
            value = value.detach()
            if weight > 0 and not torch.isnan(value):
                # float64 sums: a long window of float32 means would drift in the last digits
                self._sums[name] = self._sums.get(name, 0.0) + value.double() * weight
                self._weights[name] = self._weights.get(name, 0.0) + weight
            if self._weights.get(name, 0.0) > 0:
                means[name] = (self._sums[name] / self._weights[name]).to(value.dtype)
        return means
