"""Experiment loggers: Weights & Biases that never prompts for a login, with CSV as the fallback, and
whose run a resumed training continues.

A resume continues the same W&B run: :class:`WandbRunId` writes the run's id into every checkpoint, and
``train()`` reads it from ``ckpt_path`` (:func:`wandb_run_id`) before the logger is built, which then
passes it to ``wandb.init`` with Lightning's ``resume="allow"``. A resume from ``last.ckpt`` redoes the
steps after the checkpoint (bitwise the same, tests/test_kill9_resume.py); an online run that resumed
knows the last step its history holds (its summary's ``trainer/global_step``), and
:class:`ResumingWandbLogger` does not log those steps again. Offline there is no history to read: the
resumed run gets a new offline folder with the same run id (``wandb sync`` uploads a run's folders in
the order they started), holding the redone steps a second time, with the same values.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_vlm.ckpt_path import checkpoint_entries

log = logging.getLogger(__name__)
# Where a checkpoint keeps the W&B run it belongs to: {"id": ..., "project": ...}.
WANDB_RUN_KEY = "wandb_run"
# The x-axis Lightning logs every metric against (WandbLogger.log_metrics).
STEP_METRIC = "trainer/global_step"


def logged_step(trainer: L.Trainer) -> int:
    """The step Lightning gives the loggers for the metrics logged now: one per training batch, however many
    optimizer steps it ran (an online method's ``steps_per_generation``). What the run logs beside its
    metrics (W&B tables, images) takes it too: one x-axis, and a resumed run's history ends where its
    metrics do (``ResumingWandbLogger``), not at a table's optimizer step."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# Settings that hold credentials (the vLLM server's api_key, from $VLLM_API_KEY): kept out of what loggers
# upload. The run folder's .hydra/config.yaml keeps the unresolved ${oc.env:...} instead of the value.
SECRET_KEYS = frozenset({"api_key", "token", "hub_token", "access_token", "password", "secret"})
HIDDEN = "<hidden>"


def loggable_config(cfg: Any) -> Any:
    """``cfg`` resolved into plain containers for ``log_hyperparams``, with every credential (a
    ``SECRET_KEYS`` setting that is set) replaced by ``<hidden>``."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, DictConfig | ListConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping):
        return {
            k: HIDDEN if k in SECRET_KEYS and v is not None else loggable_config(v) for k, v in cfg.items()
        }
    if isinstance(cfg, list):
        return [loggable_config(v) for v in cfg]
    return cfg


def _wandb_key_found() -> bool | None:
    """Whether wandb finds an API key for the server it would use: WANDB_BASE_URL, else the one
    ``wandb login --host`` saved in its settings file, else its cloud, whose host and ``~/.netrc`` entry
    wandb 0.31 renamed (api.forge.coreweave.com, api.wandb.ai still read). Asked of wandb itself, since
    that lookup changes between its versions; None where this wandb has none to ask (older versions)."""
    try:
        from wandb import Settings
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import wbnetrc
    except ImportError:
        return None
    # Settings of our own, read as wandb.setup() reads them (its settings file, then the environment):
    # loading wandb's process-wide ones here would freeze them before WANDB_MODE=offline is set.
    settings = Settings(quiet=True)  # wandb.init says which settings files it loads; once is enough
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    settings.settings_system = str(
        Path(config_dir).expanduser() / "settings"
        if config_dir
        else Path.home() / ".config" / "wandb" / "settings"
    )
    try:
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
    except AttributeError:  # a wandb whose settings read otherwise: the environment is what is left
        return None
    try:
        return bool(settings.api_key or wbnetrc.read_netrc_auth(host=settings.base_url))
    except AuthenticationError:  # a key wandb refuses, saying why: the run tries, then falls back to CSV
        return True


def wandb_account_configured() -> bool:
    """True when wandb has credentials: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, or a `wandb login`
    key for the server wandb would use."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    if (found := _wandb_key_found()) is not None:
        return found
    try:
        hosts = netrc.netrc(os.environ.get("NETRC", Path.home() / ".netrc")).hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return any(host in base_url for host in hosts)


def wandb_or_csv(
    save_dir: str,
    project: str = "lightning-vlm",
    name: str | None = None,
    offline: bool | None = None,
    tags: list[str] | None = None,
    **kwargs,
) -> Logger:
    """A WandbLogger, offline when no account is configured (or `offline=True`); CSV if wandb fails.

    WANDB_MODE=offline/disabled in the environment is respected as wandb itself does.
    """
    if offline is None:
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_account_configured()
    if offline:
        # Belt and braces: wandb must never block on an interactive login in offline mode.
        os.environ.setdefault("WANDB_MODE", "offline")
    try:
        import wandb  # noqa: F401

        return ResumingWandbLogger(
            save_dir=save_dir, project=project, name=name, offline=offline, tags=list(tags or []), **kwargs
        )
    except Exception as err:  # wandb missing or broken: keep the run, log to CSV
        log.warning("wandb unavailable (%s); logging to CSV in %s instead", err, save_dir)
        return CSVLogger(save_dir=save_dir, name=name or "csv")


def start_runs(loggers: list[Logger]) -> list[Logger]:
    """``loggers`` with each W&B run started, or the logger replaced by CSV where wandb cannot start.

    WandbLogger starts wandb when first used, deep inside training, where a wandb that cannot start (no
    network, no key or a stale one) ended the run with a traceback. ``train()`` and eval start it here,
    on the rank that holds the run (the others get Lightning's dummy), so such a failure falls back.
    """
    out: list[Logger] = []
    for lg in loggers:
        if isinstance(lg, WandbLogger) and rank_zero_only.rank == 0:
            try:
                lg.experiment  # noqa: B018  (the property starts the run)
            except Exception as err:
                log.warning("wandb could not start (%s); logging to CSV in %s instead", err, lg.save_dir)
                lg = CSVLogger(save_dir=lg.save_dir or ".", name="csv")
        out.append(lg)
    return out


def finish_runs(loggers: list[Logger], exit_code: int | None = None) -> None:
    """Ends the wandb runs these loggers started: the next job of a sweep (same process) would
    otherwise log into this job's run, since WandbLogger reuses an active run. A nonzero
    ``exit_code`` marks the run failed."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg.experiment.finish(exit_code=exit_code)


@contextlib.contextmanager
def ending_runs(loggers: list[Logger]) -> Iterator[None]:
    """Ends the loggers' wandb runs when the block ends, marked failed when it raises: Hydra goes on to
    a sweep's next job after one fails, and that job would log into the failed job's run."""
    try:
        yield
    except BaseException as err:
        # SIGTERM's requeue exit (training.py) keeps its code
        code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1
        finish_runs(loggers, exit_code=code or 1)
        raise
    finish_runs(loggers)


class ResumingWandbLogger(WandbLogger):
    """A ``WandbLogger`` that, in a run W&B resumed (online), skips the steps its history already has: the
    steps a resume from a checkpoint redoes were logged by the run that crashed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._history_end: int | None = None  # last step in the run's history before this process
        # Lightning passes anonymous=None to wandb.init, which wandb >= 0.22 answers with a deprecation
        # warning at the top of every run ("The anonymous setting has no effect"), whatever its value.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    def _logged_through(self) -> int:
        if self._history_end is None:
            run = self.experiment
            last = run.summary.get(STEP_METRIC) if getattr(run, "resumed", False) else None
            self._history_end = int(last) if isinstance(last, int | float) else -1
            if self._history_end >= 0:
                # Said once: a resume from an older checkpoint (other settings) would drop real values.
                log.warning(
                    "W&B run %s resumed: its history reaches %s=%d, so steps up to it (redone since the "
                    "checkpoint) are not logged again", run.id, STEP_METRIC, self._history_end,
                )  # fmt: skip
        return self._history_end

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Logs ``metrics`` at ``step`` unless the resumed run's history already reaches ``step``."""
        if step is not None and step <= self._logged_through():
            return
        super().log_metrics(metrics, step)


class WandbRunId(L.Callback):
    """Writes the W&B run of the trainer's ``WandbLogger`` into every checkpoint (``WANDB_RUN_KEY``), so
    that a resume from it continues that run. ``train()`` adds it whenever a ``WandbLogger`` logs."""

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Adds ``{"id", "project"}`` of the first ``WandbLogger``'s run, on rank 0 (the one that writes
        the file; the other ranks have no run)."""
        if not trainer.is_global_zero:
            return
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                run_id = lg.experiment.id  # starts the run if nothing was logged yet
                if run_id:
                    checkpoint[WANDB_RUN_KEY] = {"id": str(run_id), "project": lg.name}
                return


def wandb_run_id(ckpt_path: str | os.PathLike | None) -> str | None:
    """The W&B run id stored in the local checkpoint at ``ckpt_path`` (a file, or an FSDP or DeepSpeed
    checkpoint's folder), or ``None``: none stored, or no checkpoint entries read (``checkpoint_entries``)."""
    run = (checkpoint_entries(ckpt_path) or {}).get(WANDB_RUN_KEY)
    return str(run["id"]) if isinstance(run, dict) and run.get("id") else None


def builds_wandb(target: str) -> bool:
    """Whether the ``_target_`` ``target`` builds a ``WandbLogger`` (this module's factory, or a subclass)."""
    import hydra

    try:
        built = hydra.utils.get_object(target)
    except Exception:  # not importable: instantiating the node reports it
        return False
    return built is wandb_or_csv or (isinstance(built, type) and issubclass(built, WandbLogger))
