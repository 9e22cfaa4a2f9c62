"""End-of-run report: the training curves (a PNG in the run folder, and a W&B image), and where the run's
folder, checkpoints and exported model are."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from lightning_vlm.callbacks.curves import PanelAssigner, plot_curves
from lightning_vlm.callbacks.export import ExportHFModel
from lightning_vlm.loggers import logged_step

log = logging.getLogger(__name__)


class RunReport(L.Callback):
    """Collects the panels' metrics per global step; :meth:`finish` draws them and prints the paths.

    The history comes from ``trainer.callback_metrics`` after every training batch and validation, so
    it is the same with any logger or none. ``train()`` calls :func:`finish_reports` after its last
    validation (also one it runs after fit), so the paths are the last lines of a run; code that calls
    ``trainer.fit`` itself calls ``finish_reports(trainer)`` afterwards. Only rank 0 collects and writes.

    ``panels``: panel title -> metric names or shell-style patterns (see :class:`PanelAssigner`);
    panels with nothing logged are left out of the figure.
    """

    def __init__(
        self, dirpath: str, panels: Mapping[str, Sequence[str]], filename: str = "curves.png", dpi: int = 100
    ) -> None:
        self.dirpath = Path(dirpath)
        self.assigner = PanelAssigner(panels)
        self.filename = filename
        self.dpi = dpi
        self.history: dict[str, dict[int, float]] = {}
        # panel title -> metrics drawn in it, set by finish()
        self.drawn: dict[str, list[str]] = {}
        self._recorded_at: int | None = None  # global step of the last training point

    @property
    def curves_path(self) -> Path:
        """Where the curves PNG is written."""
        return self.dirpath / self.filename

    def _record(self, trainer: L.Trainer, validation: bool) -> None:
        if not trainer.is_global_zero:
            return
        for name, value in trainer.callback_metrics.items():
            # Each hook takes its own phase's metrics: after a validation the training ones are stale.
            if name.startswith("val/") != validation or self.assigner.panel_of(name) is None:
                continue
            value = torch.as_tensor(value)
            if value.numel() == 1:
                self.history.setdefault(name, {})[trainer.global_step] = float(value)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._recorded_at = trainer.global_step  # a resumed run's restored points stay as they were

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Only after an optimizer step (keyed by step): under gradient accumulation a step's first
        # micro-batches would write their partial values over the previous step's point.
        if trainer.global_step != self._recorded_at:
            self._recorded_at = trainer.global_step
            self._record(trainer, validation=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, validation=True)

    def state_dict(self) -> dict[str, Any]:
        # In the checkpoint, so a resumed run's curves start at step 0, not at the resume step.
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, points in state_dict["history"].items():
            self.history.setdefault(name, {}).update(points)

    def finish(self, trainer: L.Trainer) -> None:
        """Saves the curves, logs them to every W&B logger, and prints the run's paths (rank 0 only)."""
        if not trainer.is_global_zero:
            return
        self.drawn = self.assigner.group(self.history)
        curves = None
        if self.drawn:
            curves = plot_curves(self.history, self.drawn, self.curves_path, dpi=self.dpi)
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.log_image(key="curves", images=[str(curves)], step=logged_step(trainer))
        emit(report_lines(trainer, self.dirpath, curves))


def report_lines(trainer: L.Trainer, run_dir: Path, curves: Path | None) -> list[str]:
    """``Label: path`` lines for the run folder, each checkpoint callback's best and last checkpoints,
    the exported model (an :class:`ExportHFModel` callback) and the curves."""
    lines = [f"Run folder:      {run_dir.resolve()}"]
    for checkpoint in trainer.checkpoint_callbacks:
        if checkpoint.best_model_path:
            score = checkpoint.best_model_score
            detail = (
                f" ({checkpoint.monitor}={float(score):.4g})"
                if checkpoint.monitor and score is not None
                else ""
            )
            lines.append(f"Best checkpoint: {Path(checkpoint.best_model_path).resolve()}{detail}")
        elif checkpoint.monitor:
            # e.g. a run shorter than val_check_interval: train() validates after fit, which saves nothing.
            lines.append(f"Best checkpoint: none saved ({checkpoint.monitor} was not logged during fit)")
        if checkpoint.last_model_path:
            lines.append(f"Last checkpoint: {Path(checkpoint.last_model_path).resolve()}")
    for callback in trainer.callbacks:
        if isinstance(callback, ExportHFModel):
            lines.append(f"Exported model:  {callback.dirpath.resolve()}")
    lines.append(
        f"Curves:          {curves.resolve() if curves else 'none (no metric of the panels was logged)'}"
    )
    return lines


def emit(lines: Sequence[str]) -> None:
    """Prints ``lines`` plainly on stdout, and writes them to the log files of the root logger."""
    print("\n".join(lines), flush=True)
    # Not log.info: the console has them from print already; this reaches Hydra's <task>.log only.
    for line in lines:
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, line, None, None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)


def finish_reports(trainer: L.Trainer) -> None:
    """Runs :meth:`RunReport.finish` of every RunReport callback of ``trainer``."""
    for callback in trainer.callbacks:
        if isinstance(callback, RunReport):
            callback.finish(trainer)
