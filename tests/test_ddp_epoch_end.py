"""A callback with a collective at a training epoch's end, on two processes with the progress bar on.
Lightning's progress bar is enabled on rank 0 only, and at the epoch's end it syncs the epoch's logged
metrics there alone (Lightning issue #21264); the other ranks sync them later. Rank 0's metric gather then
met the other rank's barrier, and the run hung."""

from __future__ import annotations

import pytest
from launch import torchrun

from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.ddp]


def test_a_callbacks_collective_at_an_epochs_end_does_not_hang(tmp_path):
    args = ["method=sft", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none",
            "trainer.limit_val_batches=0", "data.batch_size=2", "data.synthetic.num_train=8",
            "data.synthetic.num_val=4", "trainer.max_steps=4",  # 2 batches a rank: an epoch ends at step 2
            "+callbacks.barrier._target_=_kill9_scenarios.BarrierAtEpochEnd", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = torchrun(ROOT / "train.py", args, timeout=150)
    assert proc.returncode == 0, f"hung or failed: {proc.stderr[-3000:]}"
