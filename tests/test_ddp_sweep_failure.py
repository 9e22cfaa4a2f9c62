"""A job of a torchrun sweep that fails on one rank ends the sweep on every process. Hydra records the
failed job and goes on to the next, but the other ranks are still inside the failed job's collectives:
the failing rank's next job paired its own collectives (DDP's parameter broadcast, a gradient
all-reduce) with theirs, and the sweep hung, or went on with ranks a job apart."""

from __future__ import annotations

import pytest
from launch import torchrun

from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.ddp]


def test_a_job_failing_on_one_rank_ends_a_torchrun_sweep(tmp_path):
    args = ["-m", "method=sft", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "logger=none",
            "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "data.batch_size=2",
            "data.synthetic.num_train=32", "data.synthetic.num_val=4", "trainer.max_steps=4",
            "+callbacks.boom._target_=_kill9_scenarios.RaiseOnRank", "+callbacks.boom.rank=1",
            "+callbacks.boom.at_step=2,1000", f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    proc = torchrun(ROOT / "train.py", args, timeout=300)
    assert proc.returncode not in (0, -9), f"hung or went on: {proc.stderr[-3000:]}"
    out = proc.stdout + proc.stderr
    assert "boom on rank 1 at step 2" in out
    assert "[rank 1] this job failed; on several processes that ends the sweep on every process" in out
    assert not (tmp_path / "1").exists()  # no rank started the second job
