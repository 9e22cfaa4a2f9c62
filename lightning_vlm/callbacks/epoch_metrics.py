"""Every rank computes a training epoch's logged metrics at the same point.

Lightning's progress bar is enabled on rank 0 only, and at a training epoch's end it computes the
epoch's logged metrics there: a sync (torchmetrics' gather, ``sync_dist``'s reduce) on rank 0 alone. The
other ranks compute them later, when Lightning logs them (Lightning issue #21264). Any collective run in
between on those ranks (a callback's barrier or gather at the epoch's end) met rank 0's metric gather, and
the run hung. Placed before the progress bar, this computes them on every rank first; the bar and the
logger then read the values cached, the same values rank 0 computed before.
"""

from __future__ import annotations

import lightning as L


class EpochMetricsEverywhere(L.Callback):
    """Computes the epoch's logged metrics on every rank at a training epoch's end (a collective)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:
            trainer.progress_bar_metrics  # noqa: B018  (computes and caches every logged metric)
