"""``seed=null``: an unseeded run draws one seed for all its processes and says which (``seeding.py``)."""

from __future__ import annotations

import logging

import pytest

from helpers import compose_train
from lightning_vlm.seeding import DRAWN_SEED_ENV, drawn_seed
from lightning_vlm.training import train

SMALL = ["logger=none", "callbacks=none", "++tiny_start=random", "trainer.max_steps=2", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", "data.synthetic.num_train=16", "data.batch_size=4"]  # fmt: skip


@pytest.fixture(autouse=True)
def launch_env(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_RUN_ID", DRAWN_SEED_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_an_unseeded_run_trains_with_a_drawn_seed_it_names(tmp_path, caplog):
    # data.seed (${seed}) reached the sampler as None, and the first batch raised TypeError (None + epoch)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        _, out = train(compose_train([*SMALL, "seed=null"], tmp_path))
    seed = out["cfg"].seed
    assert isinstance(seed, int) and out["trainer"].global_step == 2
    assert out["datamodule"].hparams.seed == seed
    assert f"seed=null: this run draws seed={seed} (pass seed={seed} to repeat it" in caplog.text


def test_the_processes_of_one_run_share_rank_0s_seed_or_are_refused(launch_env):
    seed = drawn_seed()
    assert 0 <= seed < 2**31 and drawn_seed() != seed  # rank 0 draws afresh each run
    # A process Lightning's launcher started (its environment: rank 0's): rank 0's seed
    launch_env.setenv(DRAWN_SEED_ENV, "1234")
    launch_env.setenv("LOCAL_RANK", "1")
    assert drawn_seed() == 1234
    # What Lightning's launcher leaves in rank 0's environment (WORLD_SIZE, LOCAL_RANK=0) is no obstacle:
    # the next job of an in-process sweep draws its own
    launch_env.setenv("LOCAL_RANK", "0")
    launch_env.setenv("WORLD_SIZE", "2")
    assert drawn_seed() != 1234
    # torchrun's or srun's processes, started together, or several nodes' cannot agree on one
    for name, value in (("TORCHELASTIC_RUN_ID", "abc"), ("SLURM_STEP_NUM_TASKS", "4")):  # WORLD_SIZE=2 set
        launch_env.setenv(name, value)
        with pytest.raises(ValueError, match=r"seed=null with processes started together .*Pass seed=<int>"):
            drawn_seed()
        launch_env.delenv(name)
    with pytest.raises(ValueError, match=r"started on several nodes"):
        drawn_seed(num_nodes=2)
