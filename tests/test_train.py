"""train.py end to end: the real entry point, as a user runs it, on the tiny default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,  # a login prompt would hang; with no stdin it fails instead
    )


@pytest.mark.slow
def test_train_py_default_config_runs_a_few_steps(tmp_path):
    # The default config (wandb logger, offline without an account), shortened to a few steps.
    proc = _run(["trainer.max_steps=4", "trainer.val_check_interval=4", "data.synthetic.num_val=8"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list((tmp_path / "logs" / "sft" / "runs").iterdir())
    assert len(runs) == 1
    run = runs[0]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / ".hydra" / "config.yaml").is_file()
    assert list((run / "wandb").glob("offline-run-*")), "wandb should have written an offline run"


@pytest.mark.slow
def test_train_py_multirun_sweeps_across_methods_and_values(tmp_path):
    proc = _run(["-m", "debug=fdr", "method=sft,dpo,grpo", "method.optimizer.lr=1e-3,3e-3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted((tmp_path / "logs").glob("*/multiruns/*/[0-9]*"))
    assert len(jobs) == 6
    overrides = "".join((job / ".hydra" / "overrides.yaml").read_text() for job in jobs)
    assert all(f"method={m}" in overrides for m in ("sft", "dpo", "grpo"))
