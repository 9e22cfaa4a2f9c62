"""Step metrics over every micro-batch of an optimizer step (``trainer.accumulate_grad_batches``).

Lightning sends a step's ``on_step`` values to the logger once, after the step's last micro-batch, and
what it sends is the value that micro-batch logged. TRL averages its logged metrics over the
accumulated micro-batches. :class:`StepWindow` keeps weighted sums over the micro-batches of one
accumulation window, so each micro-batch logs the mean so far and the logger gets the whole step's.
Without accumulation the values pass unchanged. The window is named by :func:`window_of`, not by
``global_step``: under DeepSpeed, which accumulates inside its engine, Lightning counts a step per
micro-batch, yet still logs once per window.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import lightning as L
import torch


def window_of(module: L.LightningModule, batch_idx: int) -> tuple[int, int]:
    """The accumulation window of training batch ``batch_idx``: Lightning steps (and logs) after every
    ``accumulate_grad_batches``-th batch of an epoch and after its last, so (epoch, batch_idx // k)."""
    return module.current_epoch, batch_idx // module.trainer.accumulate_grad_batches


def window_end(module: L.LightningModule, batch_idx: int) -> int:
    """The batch index after training batch ``batch_idx``'s accumulation window: ``accumulate_grad_batches``
    batches from its start, fewer in an epoch's last (its end set by the loader or ``limit_train_batches``)."""
    k = module.trainer.accumulate_grad_batches
    start = batch_idx - batch_idx % k
    return start + max(1, min(k, module.trainer.num_training_batches - start))


def micro_batches_in_window(module: L.LightningModule, batch_idx: int) -> int:
    """Micro-batches in training batch ``batch_idx``'s accumulation window (see :func:`window_end`)."""
    return window_end(module, batch_idx) - (batch_idx - batch_idx % module.trainer.accumulate_grad_batches)


class WholeSteps:
    """Makes every accumulation window a whole step, as TRL's are: Lightning divides each micro-batch's
    loss by ``accumulate_grad_batches`` also where a window has fewer micro-batches (an epoch's last, or
    the rest of a window a resume started inside), so a last window of 1 micro-batch in 2 stepped by half
    its mean loss. :meth:`scale` is the factor that undoes that. 1 where the strategy accumulates
    (DeepSpeed's engine steps every ``accumulate_grad_batches`` micro-batches, across epochs)."""

    def __init__(self) -> None:
        self._window: Hashable = None
        self._first = 0  # the window's first batch this run trained

    def scale(self, module: L.LightningModule, batch_idx: int) -> float:
        """``accumulate_grad_batches`` over the micro-batches batch ``batch_idx``'s window trains."""
        trainer = module.trainer
        if trainer.strategy.handles_gradient_accumulation:
            return 1.0
        window = window_of(module, batch_idx)
        if window != self._window:
            self._window, self._first = window, batch_idx
        return trainer.accumulate_grad_batches / max(1, window_end(module, batch_idx) - self._first)


class StepWindow:
    """Weighted means of one optimizer step's metrics over the micro-batches seen so far."""

    def __init__(self) -> None:
        self._window: Hashable = None
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, float] = {}

    def update(
        self, window: Hashable, values: Mapping[str, torch.Tensor], weights: Mapping[str, float] | float
    ) -> dict[str, torch.Tensor]:
        """Add one micro-batch's means ``values`` (each over ``weights[name]`` items, or ``weights`` for
        all) to accumulation window ``window`` (:func:`window_of`); return the window's means so far. A
        metric with no items yet (weight 0: its mean is NaN or meaningless) is left out; a NaN over
        items (a diverged loss) stays NaN, so the logger shows it."""
        if window != self._window:
            self._window, self._sums, self._weights = window, {}, {}
        means = {}
        for name, value in values.items():
            weight = float(weights[name] if isinstance(weights, Mapping) else weights)
            value = value.detach()
            if weight > 0:
                # float32 (MPS has no float64); a window holds a few micro-batches
                self._sums[name] = self._sums.get(name, 0.0) + value.float() * weight
                self._weights[name] = self._weights.get(name, 0.0) + weight
            if self._weights.get(name, 0.0) > 0:
                means[name] = (self._sums[name] / self._weights[name]).to(value.dtype)
        return means
