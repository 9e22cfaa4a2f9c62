"""Processes of one run that composed different configs are refused, naming the settings: each process
composes its own (from its command line, its machine's conf/local file, its sweeper), and DDP trained
on with one learning rate per rank, without a sign."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT
from lightning_vlm.serving.process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ddp]
ARGS = ["method=sft", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none",
        "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "data.batch_size=2",
        "data.synthetic.num_train=16", "data.synthetic.num_val=4", "trainer.max_steps=2"]  # fmt: skip


def test_ranks_with_different_configs_are_refused_naming_the_settings(tmp_path):
    port = free_port()
    tasks = []
    for rank, lr in ((0, "1e-3"), (1, "2e-3")):  # a command line edited for one process
        # started by hand, as a scheduler's tasks are: Lightning reads the ranks from the environment
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LOCAL_RANK": str(rank),
               "NODE_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, f"method.optimizer.lr={lr}",
               f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
        tasks.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outputs = []
    try:
        outputs = [task.communicate(timeout=240)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert all(t.returncode == 1 for t in tasks), outputs[0][-3000:]
    for out in outputs:
        assert "the 2 processes of this run composed different configs: method.optimizer.lr: rank 0 0.001, " \
               "rank 1 0.002" in out, out[-3000:]  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
