"""A ``train.py`` run told to stop (SIGTERM: a preemption, a scheduler's time limit) saves ``last.ckpt`` at
the step it stopped, exits non-zero so a scheduler knows it did not finish, and resumes from there to the
uninterrupted run's state, bitwise. It used to save nothing and exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import fake_scontrol

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# Checkpoints far apart (every 1000 steps): whatever last.ckpt holds at step 3 was written on SIGTERM.
ARGS = ["method=sft", "logger=none", "callbacks=model_checkpoint", "~callbacks.model_checkpoint",
        "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "data.batch_size=4",
        "data.synthetic.num_train=16", "data.synthetic.num_val=4", "seed=0", "trainer.max_steps=6",
        "callbacks.last_checkpoint.every_n_train_steps=1000"]  # fmt: skip
COMPARED = ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch")


def _run(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           **(env or {})}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, *extra, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def test_sigterm_saves_the_step_exits_143_and_resumes_bitwise(tmp_path):
    stopped = _run(
        tmp_path / "stopped", "+callbacks.term._target_=_kill9_scenarios.SigTerm", "+callbacks.term.at_step=3"
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Stopped by SIGTERM at step 3" in stopped.stdout + stopped.stderr
    saved = _last(tmp_path / "stopped")
    assert saved["global_step"] == 3
    resumed = _run(tmp_path / "resumed", f"ckpt_path={tmp_path / 'stopped' / 'checkpoints' / 'last.ckpt'}")
    straight = _run(tmp_path / "straight")
    assert resumed.returncode == 0 == straight.returncode, (resumed.stderr[-2000:], straight.stderr[-2000:])
    a, b = _last(tmp_path / "straight"), _last(tmp_path / "resumed")
    assert a["global_step"] == b["global_step"] == 6
    for key in COMPARED:
        flat_a, flat_b = (
            torch.utils._pytree.tree_flatten(a[key])[0],
            torch.utils._pytree.tree_flatten(b[key])[0],
        )
        assert len(flat_a) == len(flat_b), key
        for x, y in zip(flat_a, flat_b, strict=True):
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, key
    # not vacuous: the weights moved after the stop
    assert any(not torch.equal(v, a["state_dict"][k]) for k, v in saved["state_dict"].items())


def test_sigterm_in_the_validation_before_fit_exits_143(tmp_path):
    # Only fit's SIGTERM was turned into 143: one during validate_before_fit exited 0, as if done.
    stopped = _run(tmp_path / "stopped", "validate_before_fit=true", "trainer.limit_val_batches=1",
                   "+callbacks.term._target_=_kill9_scenarios.SigTermInValidation")  # fmt: skip
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "Stopped by SIGTERM before training" in stopped.stdout + stopped.stderr


def test_slurms_requeue_signal_saves_at_the_batch_end_and_requeues(tmp_path):
    # Lightning's SLURM auto-requeue (on by default) saved an hpc checkpoint from inside the SIGUSR1
    # handler, wherever the step was (on several processes, with collectives against the other ranks'
    # work), requeued the job and trained on. Now the signal stops fit as SIGTERM does: every rank at the
    # same batch, last.ckpt saved there, then rank 0 requeues the job.
    path, calls = fake_scontrol(tmp_path)
    slurm = {"PATH": path, "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train",
             "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip
    term = ["+callbacks.term._target_=_kill9_scenarios.SigTerm", "+callbacks.term.at_step=3",
            "+callbacks.term.signum=SIGUSR1"]  # fmt: skip
    stopped = _run(tmp_path / "stopped", *term, env=slurm)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    assert _last(tmp_path / "stopped")["global_step"] == 3
    assert not list((tmp_path / "stopped").rglob("hpc_ckpt_*.ckpt"))
