"""A summary of every Hydra multirun: each job's optimised metric and overrides, and the best one.

Hydra's sweepers (basic, Optuna) hand each job's return value (train.py returns
``optimized_metric``) to the callbacks in ``hydra.callbacks``; this one collects them and writes
``summary.json`` and ``summary.md`` to the sweep folder after every job, and logs the best job when the
multirun ends, so nobody has to dig through job folders to find which settings won. After every job,
not only at the end: Hydra's basic sweeper re-raises a failed job's error before the multirun's end
hook, and the summary of the jobs that ran, the failed one included, is what a user needs then. On
several processes a failed job ends the sweep before this hook sees it (``training.failure_ends_sweep``):
the summary lists the jobs before it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_vlm.parallel.collectives import launcher_rank

log = logging.getLogger(__name__)


def best_job(jobs: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The finished job with the best value (``mode`` max or min); ``None`` when none reported one."""
    scored = [j for j in jobs if isinstance(j["value"], (int, float)) and math.isfinite(j["value"])]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda j: j["value"])


def best_per_metric(jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The best job of each metric the jobs optimise: a sweep across methods optimises each method's
    own (SFT's answer accuracy, DPO's preference accuracy, GRPO's reward), which are not comparable."""
    metrics = dict.fromkeys((j["metric"], j["mode"]) for j in jobs)
    return {metric: best_job([j for j in jobs if (j["metric"], j["mode"]) == (metric, mode)], mode)
            for metric, mode in metrics}  # fmt: skip


def sweep_mode(config: DictConfig) -> str:
    """The direction the sweep optimises ``optimized_metric`` in: the sweeper's own (Optuna's
    ``direction``: minimize / maximize) where it has one, so the summary agrees with the sweeper's
    best trial; else ``optimized_mode`` (``monitor_mode`` unless set: the checkpoints' direction)."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    if isinstance(direction, str) and direction.lower() in ("minimize", "maximize"):
        return "min" if direction.lower() == "minimize" else "max"
    mode = config.get("optimized_mode", config.get("monitor_mode", "max"))
    if mode not in ("max", "min"):
        raise ValueError(f"optimized_mode must be max or min, got {mode!r}")
    return mode


class SweepSummary(Callback):
    """Hydra callback: records each job's result and writes the sweep's summary at the end."""

    def __init__(self, filename: str = "summary") -> None:
        self.filename = filename
        self.jobs: list[dict[str, Any]] = []
        self.metric: str | None = None
        self.mode = "max"
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs = []
        # The base config's folder: a sweep over methods gives each job its own task's sweep folder.
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # Hydra calls this after a single run too: no sweep
            return
        self.metric = config.get("optimized_metric")
        self.mode = sweep_mode(config)
        failed = job_return.status == JobStatus.FAILED
        # JobReturn.return_value re-raises a failed job's exception; the stored value is what to report
        value = None if failed else job_return.return_value
        value = float(value) if isinstance(value, (int, float)) else None
        # A diverged job's NaN (or inf) is no value to rank: kept as text, so summary.json stays strict JSON
        # and summary.md lists the job after those with a value.
        reported = None if value is None or math.isfinite(value) else str(value)
        self.jobs.append({
            "job": config.hydra.job.get("num"),
            "overrides": list(job_return.overrides or []),
            # per job: a sweep across methods optimises each method's own metric
            "metric": self.metric,
            "mode": self.mode,
            "value": None if reported else value,
            "value_reported": reported,
            "status": "failed" if failed else "completed",
            "error": repr(job_return._return_value) if failed else None,
            "dir": str(config.hydra.runtime.output_dir),
        })  # fmt: skip
        self._write(config)

    def _write(self, config: DictConfig) -> tuple[Path, dict[str, dict[str, Any] | None]]:
        """Writes the summary of the jobs so far; returns its folder and the best job of each metric."""
        out = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        bests = best_per_metric(self.jobs)
        # torchrun sweeps run every job on every rank; one summary is enough
        if launcher_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            # One metric: "best" names the winner. Several: no job wins over the others ("best" is null),
            # and "best_per_metric" names each metric's.
            one = len(bests) == 1
            summary = {"metric": self.metric if one else None, "mode": self.mode if one else None,
                       "best": next(iter(bests.values())) if one else None, "best_per_metric": bests,
                       "jobs": self.jobs}  # fmt: skip
            (out / f"{self.filename}.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
            (out / f"{self.filename}.md").write_text(render_markdown(summary))
        return out, bests

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if launcher_rank() != 0 or not self.jobs:
            return
        out, bests = self._write(config)
        if len(bests) > 1:
            log.info("Sweep jobs optimise %d different metrics: no single best job", len(bests))
        for metric, best in bests.items():
            if best is None:
                log.warning("Sweep finished: no job reported %s (summary in %s)", metric, out)
            else:
                log.info("Sweep best %s=%.4f with %s (job %s); summary in %s",
                         metric, best["value"], " ".join(best["overrides"]), best["job"], out)  # fmt: skip


def render_markdown(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table, best first within each metric (what a user pastes into a report)."""

    def order(job: dict[str, Any]) -> tuple:
        value = job["value"]
        return (job["metric"] or "", value is None, -(value or 0) if job["mode"] == "max" else (value or 0))

    title = (
        f"{summary['metric']} ({summary['mode']})" if summary["metric"] else "several metrics, one best each"
    )
    lines = [f"# Sweep: {title}", "", "| job | metric | value | status | overrides |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for j in sorted(summary["jobs"], key=order):
        value = (j.get("value_reported") or "") if j["value"] is None else f"{j['value']:.4f}"
        lines.append(
            f"| {j['job']} | {j['metric']} | {value} | {j['status']} | `{' '.join(j['overrides'])}` |"
        )
    return "\n".join(lines) + "\n"
