"""The training entry point behind train.py: compose -> instantiate -> fit -> metric."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor, ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf, open_dict

import lightning_vlm.config  # noqa: F401  (registers the ${tiny_vlm:...} and ${run_folder:...} resolvers)
from lightning_vlm.callbacks.completions import LogCompletions
from lightning_vlm.callbacks.epoch_metrics import EpochMetricsEverywhere
from lightning_vlm.callbacks.export import publish_after_fit
from lightning_vlm.callbacks.resume import BatchCountAfterResume, NextEpochAfterRestart
from lightning_vlm.callbacks.rng_states import RngStates
from lightning_vlm.callbacks.run_identity import (
    RunIdentity,
    check_run_identity,
    check_time_budget,
    warn_changed_settings,
    warn_unapplied_optimizer,
    warn_unapplied_scheduler,
)
from lightning_vlm.callbacks.run_report import RunReport, finish_reports
from lightning_vlm.callbacks.same_config import SameConfig
from lightning_vlm.callbacks.sigterm import SyncedSigterm, raise_on_sigterm, requeue_if_asked
from lightning_vlm.callbacks.validated_step import ValidatedStep, validated_final_step
from lightning_vlm.ckpt_path import checkpoint_entries, checkpoint_to_load, last_checkpoint, restore_errors
from lightning_vlm.data.image_budget import warn_changed_budget
from lightning_vlm.hub_reach import offline_if_unreachable
from lightning_vlm.loggers import (
    WandbRunId,
    builds_wandb,
    ending_runs,
    loggable_config,
    start_runs,
    wandb_run_id,
)
from lightning_vlm.models.scale_guard import check_model_scale
from lightning_vlm.parallel.collectives import launcher_rank, world_size
from lightning_vlm.parallel.teardown import shut_down_at_exit
from lightning_vlm.recurring import reset_recurring
from lightning_vlm.seeding import drawn_seed
from lightning_vlm.settings_check import check_settings

log = logging.getLogger(__name__)


class _RankZero(logging.LoggerAdapter):
    """This module's messages from rank 0 only: every process runs train(), one report is enough."""

    def log(self, level: int, msg: object, *args, **kwargs) -> None:
        if launcher_rank() == 0:
            super().log(level, msg, *args, **kwargs)


log = _RankZero(log, {})


def instantiate_group(cfg: DictConfig | None) -> list[Any]:
    """Instantiates every `_target_` node of a callbacks/logger group (a dict of nodes)."""
    if not cfg:
        return []
    return [
        hydra.utils.instantiate(node)
        for node in cfg.values()
        if isinstance(node, DictConfig) and "_target_" in node
    ]


def instantiate_loggers(cfg: DictConfig | None, wandb_id: str | None = None) -> list[Any]:
    """The logger group's loggers; W&B ones continue run ``wandb_id`` (the resumed checkpoint's) unless
    their node names a run itself (``id``/``version``)."""
    loggers = []
    for node in (cfg or {}).values():
        if not (isinstance(node, DictConfig) and "_target_" in node):
            continue
        extra = {}
        if (
            wandb_id
            and node.get("id") is None
            and node.get("version") is None
            and builds_wandb(node._target_)
        ):
            log.info("Continuing W&B run %s: its id is stored in ckpt_path", wandb_id)
            extra["id"] = wandb_id
        loggers.append(hydra.utils.instantiate(node, **extra))
    return loggers


def resume_callbacks(loggers: list[Any]) -> list[L.Callback]:
    """Callbacks every run gets, whatever ``callbacks=`` says, so that its checkpoints resume it exactly:
    Lightning's epoch counters repaired after a restart on an epoch's last batch or with another global
    batch, the random-number states, the method and reference that wrote them, the W&B run's id, and a
    SIGTERM that stops every rank at the same batch."""
    from lightning.pytorch.loggers import WandbLogger

    wandb = any(isinstance(lg, WandbLogger) for lg in loggers)
    return [NextEpochAfterRestart(), BatchCountAfterResume(), RngStates(), ValidatedStep(), RunIdentity(),
            SyncedSigterm(), *([WandbRunId()] if wandb else [])]  # fmt: skip


def drop_refused(callbacks: list[Any], trainer_cfg: DictConfig, has_logger: bool) -> list[Any]:
    """The default callbacks minus those Lightning refuses in this setting, so the flag or the missing
    logger wins instead of an error: a ProgressBar next to ``enable_progress_bar=false``, a
    ModelCheckpoint next to ``enable_checkpointing=false`` (eval.py's, with the training run's
    ``callbacks=``), a LearningRateMonitor with ``logger=none``."""
    if not trainer_cfg.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    if not trainer_cfg.get("enable_checkpointing", True):
        callbacks = [c for c in callbacks if not isinstance(c, Checkpoint)]
    if not has_logger:
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return callbacks


def _no_product_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, L.LightningModule]:
    """Seeds, checks the model against its settings, and builds the datamodule and the method module
    (with its VLM): what train.py and eval.py share."""
    # Lightning's pytree helper still builds torch's deprecated LeafSpec: a FutureWarning at the top of every
    # run that says nothing about it.
    warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    # Lightning advertises its hosted services (litlogger, litmodels) in two lines at every fit, between
    # the lines a newcomer reads; the filter is added once (the same function).
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_product_tips)
    check_settings(cfg)  # settings that would fail later with a traceback, refused naming the setting
    reset_recurring()  # a sweep's next job (train or eval) warns about its own rows afresh
    offline_if_unreachable(cfg)  # a missing model or dataset named at once, not after minutes of retries
    if "seed" in cfg and cfg.seed is None:
        with open_dict(cfg):
            # data.seed (${seed}) and every other ${seed} follow
            cfg.seed = drawn_seed(int((cfg.get("trainer") or {}).get("num_nodes") or 1))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    scale = cfg.get("scale") or {}
    check_model_scale(
        scale.get("name"), cfg.model.model_name_or_path, cfg.model.get("trust_remote_code", False),
        cfg.model.get("model_kwargs"),
    )  # fmt: skip
    log.info("Instantiating datamodule <%s>", cfg.data._target_)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data, _convert_="all")
    log.info("Instantiating model <%s>", cfg.model._target_)
    vlm = hydra.utils.instantiate(cfg.model, _convert_="all")
    log.info("Instantiating method <%s>", cfg.method._target_)
    # The method receives the network (Lightning style: the system apart from the model).
    # _convert_="all": plain containers in hparams, so checkpoints load with weights_only=True.
    module: L.LightningModule = hydra.utils.instantiate(cfg.method, vlm=vlm, _convert_="all")
    return datamodule, module


def _has_validation(datamodule: L.LightningDataModule) -> bool:
    """Whether ``datamodule`` gives validation batches: Lightning's "none" is no ``val_dataloader`` or an
    empty list from it."""
    if not is_overridden("val_dataloader", datamodule):
        return False
    loaders = datamodule.val_dataloader()
    return not (isinstance(loaders, list | tuple) and len(loaders) == 0)


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Runs one training job; returns the final logged metrics and the objects it built."""
    with failure_ends_sweep():
        return _train(cfg)


@contextmanager
def failure_ends_sweep() -> Iterator[None]:
    """A job of a sweep on several processes (torchrun, a SLURM step) that fails ends this process, so
    its launcher ends the others. Hydra records a failed job and starts the next, but a rank that failed
    alone would start it while the other ranks wait inside the failed job's collectives: the next job's
    (DDP's parameter broadcast) paired with theirs, and the sweep hung or ran with ranks a job apart."""
    try:
        yield
    except Exception:
        # torchrun's processes, a SLURM step's tasks (not SLURM_NTASKS: a one-process sweep inside salloc -n 4
        # has it), or a process group a job set up
        launched = (int(os.environ.get(k, "1")) for k in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"))
        if not (_multirun() and max(world_size(), *launched) > 1):
            raise
        logging.getLogger(__name__).exception(  # on this rank: the one that failed may not be rank 0
            "[rank %d] this job failed; on several processes that ends the sweep on every process (the other "
            "ranks may be inside this job's collectives); summary.json lists the jobs before it",
            launcher_rank(),
        )
        raise SystemExit(1) from None


def _train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    shut_down_at_exit()  # before any process group exists (see parallel/teardown.py)
    datamodule, module = build(cfg)
    callbacks = instantiate_group(cfg.get("callbacks"))
    # The logger exists before the checkpoint loads (the Trainer takes it): a resumed run's W&B id is
    # read from ckpt_path first, so the run continues instead of starting a second one. "last" is read
    # from the file the fit will load (a requeued job's).
    ckpt = cfg.get("ckpt_path")
    run_id = wandb_run_id(last_checkpoint(callbacks) if ckpt == "last" else ckpt)
    if run_id and ckpt != "last" and _multirun():
        # Every job of a sweep from one checkpoint would continue its run: their logs merged into one,
        # each job's steps dropped where another's were logged. ckpt_path=last is each job's own resume.
        log.info(
            "A sweep's job starts its own W&B run; it does not continue %s, the run of ckpt_path", run_id
        )
        run_id = None
    loggers = instantiate_loggers(cfg.get("logger"), run_id)
    # From here the W&B run has started: whatever fails ends it, or the next job of a sweep would log
    # into it.
    loggers = start_runs(loggers)
    with ending_runs(loggers):
        callbacks = drop_refused(callbacks, cfg.trainer, bool(loggers))
        # SameConfig first: its setup compares the ranks' configs before other callbacks' collectives;
        # EpochMetricsEverywhere before the progress bar, which computes the epoch's metrics on rank 0 alone
        callbacks = [SameConfig(cfg), EpochMetricsEverywhere(), *callbacks, *resume_callbacks(loggers)]
        trainer: L.Trainer = hydra.utils.instantiate(
            cfg.trainer, callbacks=callbacks, logger=loggers or False
        )
        metrics, initial = _fit(cfg, trainer, module, datamodule)
    return metrics, {
        "initial_metrics": initial,
        "trainer": trainer,
        "module": module,
        "datamodule": datamodule,
        "cfg": cfg,
    }


def _warn_steps_ended_epochs(trainer: L.Trainer) -> None:
    """Says when ``trainer.max_steps`` (which every method's config sets) ended a run given
    ``trainer.max_epochs`` before those epochs were done: Lightning stops at whichever limit comes first,
    without a word, so ``max_epochs=3`` (TRL's ``num_train_epochs``) trained part of the epochs."""
    epochs, steps = trainer.max_epochs, trainer.max_steps
    if epochs in (None, -1) or steps in (None, -1) or trainer.global_step < steps:
        return
    # Lightning counts the epoch a stop cut short as done too: current_epoch is the (1-based) one it was in.
    finished = trainer.current_epoch - (0 if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch else 1)
    if finished < epochs:
        log.warning(
            "trainer.max_steps=%d ended the run in epoch %d of trainer.max_epochs=%d (Lightning stops at "
            "whichever limit comes first): set trainer.max_steps=-1 to train by epochs",
            steps, trainer.current_epoch, epochs,
        )  # fmt: skip


def _fit(
    cfg: DictConfig, trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule
) -> tuple[dict[str, float], dict[str, float]]:
    """Validates before (when asked), fits and validates once if fit did not: the final and the initial metrics."""
    check_launch(trainer)
    # A local file or folder only (a URL would be unpickled with weights_only=False), loaded weights-only.
    ckpt_path = checkpoint_to_load(cfg.get("ckpt_path"), trainer, resuming=True)
    entries = checkpoint_entries(ckpt_path) or {}  # read once, for both checks
    check_run_identity(ckpt_path, entries, module, cfg.model.model_name_or_path)
    optimizer = OmegaConf.to_container(cfg.method.get("optimizer") or {}, resolve=True)
    warn_unapplied_optimizer(ckpt_path, entries, optimizer)
    warn_unapplied_scheduler(ckpt_path, entries, module)
    check_time_budget(ckpt_path, entries, trainer)
    warn_changed_settings(ckpt_path, entries, module.hparams)
    warn_changed_budget(ckpt_path, entries.get("datamodule_hyper_parameters"), datamodule.hparams)

    for lg in trainer.loggers:
        lg.log_hyperparams(loggable_config(cfg))
    initial: dict[str, float] = {}
    exports = publish_after_fit(trainer)  # their cards wait for the final validation below
    with restore_errors(ckpt_path, module), sigterm_exits(trainer):
        if cfg.get("validate_before_fit"):
            # A resumed run starts from the checkpoint's weights, so that is the baseline to score; fit
            # below restores the checkpoint again (weights, optimizer, loops), so the resume is unchanged.
            # Lightning's validate restores weights but not the step: a resumed run's loggers would get the
            # checkpoint's scores at step 0, behind the steps they already hold (wandb drops them).
            # The callbacks that record by step (curves, completions) would draw them there too.
            loggers, trainer.loggers = trainer.loggers, [] if ckpt_path else trainer.loggers
            callbacks = trainer.callbacks
            if ckpt_path:
                trainer.callbacks = [c for c in callbacks if not isinstance(c, RunReport | LogCompletions)]
            try:
                results = trainer.validate(
                    module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False
                )
            finally:
                trainer.loggers, trainer.callbacks = loggers, callbacks
            raise_on_sigterm(trainer)
            if results:
                initial = {k: float(v) for k, v in results[0].items()}
                log.info("Metrics before training (%s): %s", ckpt_path or "initial weights", initial)
            else:  # Lightning validates nothing without validation batches, and returns no metrics
                log.warning(
                    "validate_before_fit=true: the data has no validation rows, so nothing was validated "
                    "before training (set data.val, or data.val_fraction to hold out part of data.train)"
                )
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    _warn_steps_ended_epochs(trainer)
    wanted = cfg.get("optimized_metric")
    stale = wanted in trainer.callback_metrics and not validated_final_step(trainer)
    if (
        wanted
        and (wanted not in trainer.callback_metrics or stale)
        and trainer.limit_val_batches != 0
        and _has_validation(datamodule)
    ):
        # The run ended before its first validation (e.g. trainer.max_steps below val_check_interval), or
        # after its last one (max_steps=3, val_check_interval=2): validate the final weights once, so a
        # short run and a sweep report their metric, and the model card the exported weights'.
        log.info(
            "No validation ran at the last step of fit: validating the final weights once for %s", wanted
        )
        with sigterm_exits(trainer):
            trainer.validate(module, datamodule=datamodule, verbose=False)
            raise_on_sigterm(trainer)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1}
    log.info("Final metrics: %s", metrics)
    for export in exports:
        export.publish(trainer, module)  # the card holds the final metrics, those of any validation above
    metric_value(metrics, wanted)  # a warning when it was never logged, before the run's last lines
    finish_reports(trainer)  # curves and paths: the run's last lines, after any final validation
    return metrics, initial


def check_launch(trainer: L.Trainer) -> None:
    """Refuse a Hydra sweep whose jobs Lightning would launch on several processes itself.

    Lightning's launcher starts the other ranks by re-running this command line; under ``-m`` every
    child would run the whole sweep again. Under torchrun or SLURM the processes exist already, each
    runs the same jobs in the same order, and the sweep works.
    """
    if not _multirun():
        return
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if trainer.world_size > 1 and environment is not None and not environment.creates_processes_externally:
        raise RuntimeError(
            f"Hydra multirun (-m) with {trainer.world_size} processes: Lightning would start the other "
            "processes by re-running this command, and each would run the whole sweep again. Launch the "
            "sweep with torchrun instead, which starts the processes once (each runs every job in order): "
            f"`torchrun --nproc_per_node={trainer.num_devices} train.py -m ...`, or run the jobs one by one "
            "without -m."
        )


def _multirun() -> bool:
    """Whether this job is one of a Hydra sweep's (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@contextmanager
def sigterm_exits(trainer: L.Trainer, stopped: str | None = None) -> Iterator[None]:
    """SIGTERM (a preemption, a time limit) during fit or its validations exits 143, logging ``stopped``
    (default: what a resume needs). Lightning ends with a SystemExit without a code: the job would exit 0,
    as if done, and a scheduler would not requeue it. A stop inside fit left last.ckpt at the stopped step
    (callbacks.last_checkpoint)."""
    try:
        yield
    except SIGTERMException:
        requeued = requeue_if_asked(trainer)  # SLURM's requeue signal: its requeued job resumes
        if stopped:
            log.warning(stopped)
        elif trainer.global_step:
            log.warning("Stopped by %s at step %d; resume with ckpt_path=<run>/checkpoints/last.ckpt",
                        "SLURM's requeue signal" if requeued else "SIGTERM", trainer.global_step)  # fmt: skip
        else:
            log.warning("Stopped by SIGTERM before training (step 0): nothing to resume, run it again")
        raise SystemExit(128 + signal.SIGTERM) from None


def metric_value(metrics: dict[str, float], name: str | None, warn: bool = True) -> float | None:
    """The value a sweeper optimises; ``None`` when it was never logged (no validation data, or
    ``trainer.limit_val_batches=0``), with a warning naming what was logged unless ``warn`` is False."""
    if not name:
        return None
    if name not in metrics and warn:
        log.warning(
            "optimized_metric=%r was not logged (no validation ran); returning None. Logged metrics: %s",
            name, sorted(metrics),
        )  # fmt: skip
    return metrics.get(name)
