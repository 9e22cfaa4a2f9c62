"""Experiment loggers: Weights & Biases that never prompts for a login, with CSV as the fallback."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

log = logging.getLogger(__name__)


def wandb_account_configured() -> bool:
    """True when wandb has credentials: WANDB_API_KEY, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
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

        return WandbLogger(
            save_dir=save_dir, project=project, name=name, offline=offline, tags=list(tags or []), **kwargs
        )
    except Exception as err:  # wandb missing or broken: keep the run, log to CSV
        log.warning("wandb unavailable (%s); logging to CSV in %s instead", err, save_dir)
        return CSVLogger(save_dir=save_dir, name=name or "csv")


def finish_runs(loggers: list[Logger]) -> None:
    """Ends the wandb runs these loggers started: the next job of a sweep (same process) would
    otherwise log into this job's run, since WandbLogger reuses an active run."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg._experiment is not None:
            lg.experiment.finish()
