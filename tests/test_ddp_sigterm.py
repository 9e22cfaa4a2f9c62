"""SIGTERM on two processes, for real (torchrun, gloo): a signal that reaches one rank stops both at the
same batch, and ``last.ckpt`` holds that step. A scheduler signals every task, but not at the same
instant; Lightning 2.6 stopped each rank where its own signal came, so a rank that got it one batch
earlier ran the checkpoint's collectives against the other's gradient all-reduce: the job hung until
killed and wrote no ``last.ckpt`` (``callbacks/sigterm.py``). The one-process save and its bitwise
resume are ``test_sigterm_checkpoint.py``'s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from launch import torchrun

from helpers import ROOT, fake_scontrol
from lightning_vlm.serving.process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ddp]
# A validation follows step 3, the progress bar on: rank 0's bar syncs logged metrics where rank 1 does
# not, so a collective added at an epoch's or a validation's end hung (the fix's first version).
ARGS = ["method=sft", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none",
        "callbacks=model_checkpoint", "~callbacks.model_checkpoint", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1", "data.batch_size=2", "data.synthetic.num_train=32",
        "data.synthetic.num_val=4", "seed=0", "trainer.max_steps=6",
        "callbacks.last_checkpoint.every_n_train_steps=1000"]  # fmt: skip


def test_sigterm_on_one_rank_stops_both_at_that_step_and_saves_it(tmp_path):
    term = ["+callbacks.term._target_=_kill9_scenarios.SigTerm", "+callbacks.term.at_step=3",
            "+callbacks.term.rank=1", "+callbacks.count._target_=_kill9_scenarios.ValidationBatches",
            f"+callbacks.count.path={tmp_path / 'validation_batches.txt'}"]  # fmt: skip
    proc = torchrun(ROOT / "train.py", [*ARGS, *term, f"hydra.run.dir={tmp_path}"], timeout=300)
    assert proc.returncode != -9, f"hung: {proc.stderr[-3000:]}"
    # Rank 1 exits 143 (SIGTERM's code); torchrun then ends rank 0 with SIGTERM if it is still tearing down.
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)}
    assert codes and codes <= {128 + signal.SIGTERM, -signal.SIGTERM}, proc.stderr[-3000:]
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
    # Both stopped before step 3's validation (Lightning ran one of its batches first, generations for
    # online methods, inside the scheduler's grace period).
    assert (tmp_path / "validation_batches.txt").read_text() == ""


def test_slurms_requeue_signal_on_one_task_stops_both_saves_and_requeues_once(tmp_path):
    # Two tasks as srun starts them (each its SLURM_PROCID); SIGUSR1 reaches task 1 alone at step 3.
    # Lightning's auto-requeue handler saved from inside the signal handler on that rank alone, with the
    # checkpoint's collectives against the other's training, and trained on.
    path, calls = fake_scontrol(tmp_path)
    port = free_port()
    term = ["+callbacks.term._target_=_kill9_scenarios.SigTerm", "+callbacks.term.at_step=3",
            "+callbacks.term.rank=1", "+callbacks.term.signum=SIGUSR1"]  # fmt: skip
    tasks = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "PATH": path, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
               "SLURM_JOB_NAME": "train",
               "SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, *term, f"hydra.run.dir={tmp_path / 'run'}"]
        tasks.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = []
    try:
        for task in tasks:
            outputs.append(task.communicate(timeout=240)[0])
    finally:
        for task in tasks:
            task.kill()
    assert [t.returncode for t in tasks] == [128 + signal.SIGTERM] * 2, outputs[-1][-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]  # rank 0 alone, once
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
