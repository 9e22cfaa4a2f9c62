"""Log sample completions (TRL's ``log_completions``): a W&B table, a JSONL file, a console table.

Online methods (GRPO, GSPO, RLOO, Online DPO) are asked for their rollouts every
``log_completions_steps`` optimizer steps: step, image, prompt, completion, each reward function's
value, the total reward and the advantage. SFT, DPO and KTO are asked at each validation for the greedy
answers of its first batch: step, image, prompt, completion, reference answer and whether it matched.

Where they go, all on global rank 0 only (its own samples: no images cross processes):

- every ``WandbLogger``: a ``wandb.Table`` under ``completions`` (TRL's key) or ``val/completions``;
- with any other logger, or none: the same rows appended to ``completions.jsonl`` in
  ``trainer.default_root_dir``, each image saved once as a PNG under ``completions/`` and named by
  its path relative to that folder. ``default_root_dir`` is the run folder (``paths.output_dir``)
  whichever loggers run, while ``trainer.log_dir`` moves with the first logger (``csv/version_0/``
  for CSV, wandb's ``save_dir`` for W&B);
- the console: the first ``num_completions_to_print`` rows as a rich table (the first, not TRL's
  random ones: drawing them would move Python's RNG, and with it a resumed run's data order).
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from tqdm import tqdm

from lightning_vlm.loggers import logged_step
from lightning_vlm.methods.completions import CompletionRecorder, CompletionSample, RecordsCompletions

log = logging.getLogger(__name__)

JSONL_NAME = "completions.jsonl"
IMAGE_DIR = "completions"
# wandb keys per stage: TRL logs its training table as "completions".
TABLE_KEYS = {"train": "completions", "val": "val/completions"}


class LogCompletions(L.Callback):
    """TRL's ``log_completions`` / ``num_completions_to_print``, plus how often (``log_completions_steps``).

    Args:
        log_completions: log sample completions at all (TRL's default is off).
        num_completions_to_print: rows printed to the console per log; None prints all, as TRL.
            The W&B table and the JSONL file get every recorded row.
        log_completions_steps: log online rollouts every this many optimizer steps (from step 0);
            None uses ``trainer.log_every_n_steps``, as TRL logs completions every ``logging_steps``.
    """

    def __init__(
        self,
        log_completions: bool = False,
        num_completions_to_print: int | None = None,
        log_completions_steps: int | None = None,
    ) -> None:
        if log_completions_steps is not None and log_completions_steps < 1:
            raise ValueError(f"log_completions_steps must be >= 1 or null, got {log_completions_steps}")
        if num_completions_to_print is not None and num_completions_to_print < 0:
            raise ValueError(f"num_completions_to_print must be >= 0 or null, got {num_completions_to_print}")
        self.log_completions = log_completions
        self.num_completions_to_print = num_completions_to_print
        self.log_completions_steps = log_completions_steps
        self._last_bucket: int | None = None
        self._train_step = 0
        self._warned_no_rich = False

    # ---- asking the method for samples -----------------------------------------------------------------
    def _recorder(self, trainer: L.Trainer, pl_module: L.LightningModule) -> CompletionRecorder | None:
        # Only rank 0 is ever asked: the other ranks' methods build nothing.
        active = self.log_completions and trainer.is_global_zero and isinstance(pl_module, RecordsCompletions)
        return pl_module.completion_recorder if active else None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder(trainer, pl_module)
        if recorder is None:
            return
        # The first batch at or past each multiple of N: one log per N steps also when a batch takes
        # several optimizer steps (steps_per_generation × num_iterations).
        bucket = trainer.global_step // (self.log_completions_steps or max(trainer.log_every_n_steps, 1))
        if bucket != self._last_bucket:
            self._last_bucket, self._train_step = bucket, trainer.global_step
            recorder.request("train")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder(trainer, pl_module)
        if recorder is not None:
            # The step whose policy generated them (the batch's optimizer steps came after).
            # The loggers' step is still the batch's: Lightning raises it after this hook.
            self.write(trainer, "train", self._train_step, recorder.take("train"), logged_step(trainer))

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        recorder = self._recorder(trainer, pl_module)
        if recorder is not None and not trainer.sanity_checking:
            recorder.request("val")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        recorder = self._recorder(trainer, pl_module)
        if recorder is not None:
            self.write(trainer, "val", trainer.global_step, recorder.take("val"), logged_step(trainer))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(pl_module, RecordsCompletions):
            pl_module.completion_recorder.clear()

    # ---- writing them out ---------------------------------------------------------------------------------
    def write(
        self, trainer: L.Trainer, stage: str, step: int, samples: list[CompletionSample], logger_step: int
    ) -> None:
        """Send ``samples`` to every W&B logger, to the JSONL file (other loggers) and to the console.

        ``step`` is the optimizer step (the table's column, the file's and the console's, as checkpoints
        and curves count); ``logger_step`` the loggers' x-axis of the metrics logged with them
        (``logged_step``)."""
        if not samples:
            return
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        for logger in wandb_loggers:
            self._log_table(logger, stage, step, samples, logger_step)
        if len(wandb_loggers) < len(trainer.loggers) or not trainer.loggers:
            append_jsonl(Path(trainer.default_root_dir), stage, step, samples)
        self._print(stage, step, samples)

    @staticmethod
    def _log_table(
        logger: WandbLogger, stage: str, step: int, samples: list[CompletionSample], logger_step: int
    ) -> None:
        import wandb

        # One wandb.Image per distinct image: the G completions of a prompt share their prompt's.
        images: dict[int, wandb.Image] = {}
        data = []
        for s in samples:
            if s.image is not None and id(s.image) not in images:
                images[id(s.image)] = wandb.Image(s.image)
            image = images[id(s.image)] if s.image is not None else None
            data.append([step, image, s.prompt, s.completion, *s.values.values()])
        logger.log_table(TABLE_KEYS[stage], columns=columns(samples), data=data, step=logger_step)

    def _print(self, stage: str, step: int, samples: list[CompletionSample]) -> None:
        shown = samples[: self.num_completions_to_print]
        if shown and not print_completions(TABLE_KEYS[stage], step, shown) and not self._warned_no_rich:
            log.warning("rich is not installed: completions are not printed (pip install rich)")
            self._warned_no_rich = True


def columns(samples: list[CompletionSample]) -> list[str]:
    """The table's columns: step, image, prompt, completion, then the method's own values."""
    return ["step", "image", "prompt", "completion", *samples[0].values]


def append_jsonl(root: Path, stage: str, step: int, samples: list[CompletionSample]) -> None:
    """Append one JSON line per sample to ``root/completions.jsonl``; images saved once as PNGs."""
    paths: dict[int, str] = {}
    lines = []
    prefix = f"{stage}-step{step:06d}"
    # Numbered after the step's images already there: a run resumed into its folder logs some steps
    # again, and the earlier lines keep pointing at their own images.
    first = len(list((root / IMAGE_DIR).glob(f"{prefix}-*.png")))
    for s in samples:
        if s.image is not None and id(s.image) not in paths:
            relative = f"{IMAGE_DIR}/{prefix}-{first + len(paths):03d}.png"
            (root / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
            s.image.save(root / relative)
            paths[id(s.image)] = relative
        image = paths[id(s.image)] if s.image is not None else None
        row = {"stage": stage, "step": step, "image": image, "prompt": s.prompt, "completion": s.completion}
        lines.append(json.dumps({**row, **s.values}) + "\n")
    with open(root / JSONL_NAME, "a", encoding="utf-8") as f:
        f.writelines(lines)


def print_completions(title: str, step: int, samples: list[CompletionSample]) -> bool:
    """Print ``samples`` as a rich table (no images); False when rich is not installed (as TRL, the
    console table needs rich and nothing else does)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(title=f"{title} at step {step}", show_lines=True)
    for name in columns(samples)[2:]:
        table.add_column(name, overflow="fold")
    for s in samples:
        table.add_row(s.prompt, s.completion, *(_cell(v) for v in s.values.values()))
    # Rendered first and written with tqdm.write, which lifts the progress bars and redraws them below
    # (printed directly, the table would start on the bar's line and the bar would repeat under it).
    terminal = Console()
    buffer = io.StringIO()
    console = Console(file=buffer, width=terminal.width, force_terminal=terminal.is_terminal,
                      color_system=terminal.color_system)  # fmt: skip
    console.print(table)
    tqdm.write(buffer.getvalue().rstrip("\n"))
    return True


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
