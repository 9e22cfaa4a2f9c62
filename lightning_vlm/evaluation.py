"""The evaluation entry point behind eval.py: compose -> instantiate -> trainer.validate -> JSON report.

The numbers are the method's own validation metrics (``trainer.validate`` of the method module): SFT's
held-out answer accuracy, DPO's preference accuracy (``val/rewards/accuracies``), an online method's
mean reward and each reward function's mean (``val/rewards/<name>``), and whatever else it logs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_vlm.callbacks.run_identity import check_run_identity
from lightning_vlm.callbacks.same_config import SameConfig
from lightning_vlm.callbacks.sigterm import SyncedSigterm
from lightning_vlm.ckpt_path import checkpoint_entries, checkpoint_to_load, restore_errors
from lightning_vlm.data.image_budget import warn_changed_budget
from lightning_vlm.data.sources import plain
from lightning_vlm.loggers import ending_runs, start_runs
from lightning_vlm.methods.dpo import DPO
from lightning_vlm.methods.kto import KTO
from lightning_vlm.parallel.teardown import shut_down_at_exit
from lightning_vlm.training import build, drop_refused, instantiate_group, sigterm_exits

log = logging.getLogger(__name__)


class RowCounter(L.Callback):
    """Counts the validation rows the module scored (what ``limit_val_batches`` and sharding left)."""

    def __init__(self) -> None:
        self.rows = 0

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self.rows += len(batch)

    def total(self, trainer: L.Trainer) -> int:
        """Rows scored by every rank together (a collective: every rank calls it)."""
        # On the strategy's device: NCCL reduces CUDA tensors only.
        count = torch.tensor(float(self.rows), device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(count, reduce_op="sum").item())


# What makes data.train the same data: then the checkpoint's held-out rows can be compared with eval's.
_SOURCE_KEYS = ("train", "split", "synthetic", "column_map", "max_samples")


def check_held_out_rows(ckpt_path: str, data: Any) -> None:
    """Refuse to score rows ``ckpt_path`` trained on: eval's ``data.val_fraction`` holds out a seeded sample of
    ``data.train``; unless the checkpoint's run held out the same sample (same data, ``val_fraction`` and
    seed), some of them were its training rows, and their scores would flatter it with no sign why."""
    if not data.get("val_fraction"):
        return
    # A file, or a sharded checkpoint's folder (its meta.pt): Lightning's entries, not the weights.
    trained = (checkpoint_entries(ckpt_path) or {}).get("datamodule_hyper_parameters")
    if not trained or any(plain(trained.get(k)) != plain(data.get(k)) for k in _SOURCE_KEYS):
        return  # other data (or a checkpoint without its data settings): nothing to compare
    if not trained.get("val_fraction"):
        raise ValueError(
            f"data.val_fraction={data['val_fraction']} holds out rows of data.train={data['train']!r}, but "
            f"the checkpoint {ckpt_path} trained on all of data.train (its data.val_fraction was "
            f"{trained.get('val_fraction')}): every row eval would score was trained on. Give held-out rows "
            "as data.val=<file or dataset> (and data.val_fraction=0)"
        )
    ours = {k: data.get(k) for k in ("val_fraction", "seed")}
    theirs = {k: trained.get(k) for k in ("val_fraction", "seed")}
    if ours != theirs:
        raise ValueError(
            f"data.val_fraction={ours['val_fraction']} with data.seed={ours['seed']} holds out other rows of "
            f"data.train={data['train']!r} than the checkpoint trained without: the checkpoint trained with "
            f"data.val_fraction={theirs['val_fraction']} and data.seed={theirs['seed']}, so some rows eval "
            f"would score were trained on. Pass its settings (seed={theirs['seed']} sets data.seed, "
            f"data.val_fraction={theirs['val_fraction']}), or give held-out rows as data.val"
        )


def evaluate(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    """Scores ``cfg.ckpt_path`` (or ``cfg.model``'s weights) on the validation set; returns the report
    and where it was written (rank 0 writes it)."""
    shut_down_at_exit()  # before any process group exists (see parallel/teardown.py)
    datamodule, module = build(cfg)
    counter = RowCounter()
    loggers = start_runs(instantiate_group(cfg.get("logger")))
    # The W&B run has started: whatever fails below ends it.
    with ending_runs(loggers):
        callbacks = [
            SameConfig(cfg),  # first: the ranks' configs compared before other callbacks' collectives
            *drop_refused(instantiate_group(cfg.get("callbacks")), cfg.trainer, bool(loggers)),
            counter,
            SyncedSigterm(),  # every rank stops at the same batch (a skewed signal hung Lightning's ranks)
        ]
        trainer: L.Trainer = hydra.utils.instantiate(
            cfg.trainer, callbacks=callbacks, logger=loggers or False
        )
        ckpt_path = checkpoint_to_load(cfg.get("ckpt_path"), trainer)
        check_run_identity(
            ckpt_path, checkpoint_entries(ckpt_path) or {}, module, cfg.model.model_name_or_path
        )
        if isinstance(module, DPO | KTO) and ckpt_path is None:
            # DPO's and KTO's reference is a copy of the model they were built from: scoring an HF folder
            # against itself gives every implicit reward 0 (preference accuracy 0.5 by construction).
            log.warning(
                "Evaluating %s without ckpt_path: the reference is %s itself, so val/rewards/* compare it "
                "with itself. Evaluate the Lightning checkpoint (reference = the model training began from, or the "
                "one TR-DPO's syncs left).",
                type(module).__name__, cfg.model.model_name_or_path,
            )  # fmt: skip

        if ckpt_path is not None:
            check_held_out_rows(ckpt_path, datamodule.hparams)
            trained = (checkpoint_entries(ckpt_path) or {}).get("datamodule_hyper_parameters")
            warn_changed_budget(ckpt_path, trained, datamodule.hparams)
        stopped = "Stopped by SIGTERM during the evaluation: no report written; run it again"
        with restore_errors(ckpt_path, module), sigterm_exits(trainer, stopped):
            results = trainer.validate(
                module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False
            )
        rows = counter.total(trainer)
        if not results or rows == 0:
            raise ValueError(
                "no validation rows were scored: set data.val=<file or dataset> (or data.val_fraction), "
                "and check trainer.limit_val_batches"
            )
    report = {
        "metrics": {k: float(v) for k, v in sorted(results[0].items())},
        "ckpt_path": ckpt_path,
        "model_name_or_path": cfg.model.model_name_or_path,
        "method": cfg.method._target_,
        "task_name": cfg.get("task_name"),
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "num_rows": rows,
    }
    path = Path(cfg.report_path)
    if trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.info("Metrics of %s on %d rows: %s", ckpt_path or cfg.model.model_name_or_path, rows,
                 report["metrics"])  # fmt: skip
    return report, path
