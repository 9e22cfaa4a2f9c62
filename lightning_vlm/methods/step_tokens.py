"""The target tokens of a whole optimizer step, for SFT under gradient accumulation (TRL's ``num_items_in_batch``).

Lightning backpropagates each micro-batch of an accumulation window on its own and divides its loss by
``accumulate_grad_batches``. A token mean per micro-batch would weigh a token of a micro-batch with few
target tokens more than one of a micro-batch with many, and the step's last, shorter window of an epoch
would take a smaller step. TRL divides every micro-batch by the token count of the whole step, so the
step's gradient is the token mean of all its rows: the gradient of one batch holding them all. With a
:class:`~lightning_vlm.data.lookahead.LookaheadBatch`, :class:`StepTokens` does that: at a window's first
micro-batch it encodes the window's rows, counts their target tokens over every rank (one all-reduce)
and keeps the encodings for the micro-batches that follow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import lightning as L
import torch

from lightning_vlm.data.lookahead import LookaheadBatch
from lightning_vlm.methods.step_window import window_end, window_of
from lightning_vlm.parallel.collectives import mean_normalizer

log = logging.getLogger(__name__)


def target_tokens(inputs: dict) -> torch.Tensor:
    """The target (trained) tokens of encoded SFT inputs."""
    return (inputs["labels"] != -100).sum()


def batches_left_in_window(module: L.LightningModule, batch_idx: int) -> int:
    """Micro-batches after ``batch_idx`` in its accumulation window, the ones a look ahead counts."""
    return window_end(module, batch_idx) - 1 - batch_idx


class StepTokens:
    """Encodes one micro-batch of SFT rows and gives the divisor of its summed loss: the target tokens of
    its whole accumulation window over every rank, divided by the world size (see ``mean_normalizer``)."""

    def __init__(self, encode: Callable[[list[dict]], dict]) -> None:
        self.encode = encode
        self._window: Hashable = None
        self._encoded: dict[int, dict] = {}  # the window's later micro-batches, by loader index
        self._divisor: torch.Tensor | None = None
        self._warned = False

    def take(
        self, module: L.LightningModule, batch: LookaheadBatch | list[dict], batch_idx: int
    ) -> tuple[dict, torch.Tensor]:
        """(this micro-batch's encoded inputs, the divisor of its summed loss). A collective at the first
        micro-batch of each window (every rank reaches it at the same batch)."""
        if not isinstance(batch, LookaheadBatch):
            inputs, k = self.encode(batch), module.trainer.accumulate_grad_batches
            if k > 1 and not self._warned:
                self._warned = True
                log.warning(
                    "the train loader's batches cannot look ahead (LookaheadBatch), so each of the %d accumulated "
                    "micro-batches is divided by its own target tokens, not by the step's (as TRL does)", k,
                )  # fmt: skip
            # k × its own tokens: after Lightning's division by k, the step is the mean of the micro-batches' means
            return inputs, mean_normalizer(target_tokens(inputs).to(module.device)) * k
        window = window_of(module, batch_idx)
        if window != self._window or batch.index not in self._encoded:
            # A new window (or a resume inside one: its earlier micro-batches' gradients are gone)
            inputs = self.encode(batch.rows)
            later = batch.after(batches_left_in_window(module, batch_idx))
            self._window, self._encoded = window, {i: self.encode(rows) for i, rows in later}
            count = target_tokens(inputs) + sum(target_tokens(e) for e in self._encoded.values())
            self._divisor = mean_normalizer(count.to(module.device))
            return inputs, self._divisor
        return self._encoded.pop(batch.index), self._divisor
