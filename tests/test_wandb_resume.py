"""A resumed run continues its W&B run: the run id travels in the checkpoint, and ``train()`` hands it to
the logger (with ``resume="allow"``) before the run starts. Offline, as without an account: the offline
run folder's name ends with the run id."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from helpers import compose_train
from lightning_vlm.loggers import STEP_METRIC, WANDB_RUN_KEY, ResumingWandbLogger, wandb_run_id
from lightning_vlm.training import instantiate_loggers, train

FAST = [
    "method=sft",
    "logger=wandb",
    # last.ckpt only (the best-by-metric checkpoint needs validation, off here)
    "callbacks=model_checkpoint",
    "~callbacks.model_checkpoint",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "data.batch_size=4",
    "data.synthetic.num_train=16",
    "data.synthetic.num_val=4",
]


def _first_run(folder, monkeypatch) -> str:
    """Two steps offline (as without a W&B account) in ``folder``; its W&B run id."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _, first = train(compose_train([*FAST, "trainer.max_steps=2"], folder))
    return first["trainer"].logger.version


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    run_id = _first_run(tmp_path / "a", monkeypatch)
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)[WANDB_RUN_KEY] == {"id": run_id, "project": "lightning-vlm"}

    _, second = train(compose_train([*FAST, "trainer.max_steps=4", f"ckpt_path={last}"], tmp_path / "b"))
    logger = second["trainer"].logger
    assert second["trainer"].global_step == 4
    assert isinstance(logger, ResumingWandbLogger) and logger.version == run_id
    # What wandb.init was given and the run it made: the same id, resumed if the run exists ("allow").
    assert logger._wandb_init["id"] == run_id and logger._wandb_init["resume"] == "allow"
    assert logger._experiment.id == run_id and logger._experiment.settings.resume == "allow"
    (a,) = (tmp_path / "a" / "wandb").glob("offline-run-*")
    (b,) = (tmp_path / "b" / "wandb").glob("offline-run-*")
    assert a.name.endswith(f"-{run_id}") and b.name.endswith(f"-{run_id}") and a != b
    # The resumed run's checkpoints name the same run: a second resume continues it too.
    assert wandb_run_id(tmp_path / "b" / "checkpoints" / "last.ckpt") == run_id


def test_ckpt_path_last_continues_the_wandb_run_of_the_checkpoint_it_finds(tmp_path, monkeypatch):
    # A requeued job: the same run folder, ckpt_path=last. The id used to be read from the keyword itself
    # (no file), so every requeue started a new W&B run.
    run_id = _first_run(tmp_path, monkeypatch)
    _, second = train(compose_train([*FAST, "trainer.max_steps=4", "ckpt_path=last"], tmp_path))
    assert second["trainer"].global_step == 4 and second["trainer"].logger.version == run_id


def test_a_failed_job_ends_its_wandb_run_and_the_next_job_gets_its_own(tmp_path, monkeypatch):
    # Hydra's sweeps go on to the next job after one fails; its WandbLogger reused the failed job's
    # run, which was still active, and logged into it.
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="boom in training"):
        train(compose_train([*FAST, "trainer.max_steps=2", "+callbacks.boom._target_=helpers.RaiseAt"],
                            tmp_path / "failed"))  # fmt: skip
    assert wandb.run is None
    _, second = train(compose_train([*FAST, "trainer.max_steps=1"], tmp_path / "next"))
    (failed,) = (tmp_path / "failed" / "wandb").glob("offline-run-*")
    assert not failed.name.endswith(second["trainer"].logger.version)
    assert wandb.run is None


def test_a_logger_node_that_names_its_run_keeps_it_and_other_loggers_get_no_id(tmp_path):
    cfg = compose_train(["logger=many_loggers", "logger.wandb.offline=true"], tmp_path)
    wandb, csv = instantiate_loggers(cfg.logger, "from-ckpt")
    assert wandb._wandb_init["id"] == "from-ckpt" and isinstance(csv, CSVLogger)
    cfg = compose_train(["logger=wandb", "logger.wandb.offline=true", "+logger.wandb.id=mine"], tmp_path)
    (wandb,) = instantiate_loggers(cfg.logger, "from-ckpt")
    assert wandb._wandb_init["id"] == "mine"
    (fresh,) = instantiate_loggers(cfg.logger, None)
    assert fresh._wandb_init["id"] == "mine"


class _ResumedRun:
    """What wandb.init returns for a run it resumed online: its summary holds the last step logged."""

    def __init__(self, resumed: bool, last_step: int | None) -> None:
        self.id, self.resumed = "run1", resumed
        self.summary = {} if last_step is None else {STEP_METRIC: last_step}
        self.logged: list[dict] = []

    def log(self, data: dict) -> None:
        self.logged.append(data)


def _logged_steps(run: _ResumedRun, tmp_path) -> list:
    logger = ResumingWandbLogger(save_dir=str(tmp_path), offline=True, experiment=run)
    for step in (4, 5, 6, 7):
        logger.log_metrics({"train/loss": float(step)}, step=step)
    logger.log_metrics({"no step": 1.0})
    return [row.get(STEP_METRIC) for row in run.logged]


def test_steps_a_resumed_run_already_logged_are_not_logged_again(tmp_path):
    # A resume from last.ckpt at step 3 redoes steps 4-5, which the killed run had logged.
    assert _logged_steps(_ResumedRun(resumed=True, last_step=5), tmp_path) == [6, 7, None]
    # A new run (or an offline one: nothing to read) logs everything.
    assert _logged_steps(_ResumedRun(resumed=False, last_step=None), tmp_path) == [4, 5, 6, 7, None]


def test_the_run_id_is_read_only_from_local_checkpoints_that_load(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {}, WANDB_RUN_KEY: {"id": "abc123", "project": "p"}}, good)
    assert wandb_run_id(good) == "abc123" and wandb_run_id(str(good)) == "abc123"
    sharded = tmp_path / "sharded.ckpt"  # Lightning's FSDP folder: everything but tensors in meta.pt
    sharded.mkdir()
    torch.save({WANDB_RUN_KEY: {"id": "def456"}}, sharded / "meta.pt")
    assert wandb_run_id(sharded) == "def456"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):  # ZeRO-2, ZeRO-3
        deepspeed = tmp_path / f"{name}.ckpt" / "checkpoint"
        deepspeed.mkdir(parents=True)
        torch.save({"module": {}, WANDB_RUN_KEY: {"id": "ghi789"}}, deepspeed / name)
        assert wandb_run_id(deepspeed.parent) == "ghi789"  # a resumed DeepSpeed run started a new W&B run
    torch.save({"state_dict": {}}, tmp_path / "old.ckpt")
    (tmp_path / "noise.ckpt").write_bytes(os.urandom(4096))
    # None: the fit's own load then reports what is wrong (or the run simply starts a new W&B run).
    for path in ("old.ckpt", "noise.ckpt", "missing.ckpt"):
        assert wandb_run_id(tmp_path / path) is None
    assert wandb_run_id(None) is None and wandb_run_id("https://example.com/last.ckpt") is None
    assert wandb_run_id("last") is None  # Lightning's keyword, resolved by the fit itself


def test_sweep_jobs_from_one_checkpoint_start_their_own_wandb_runs(tmp_path, monkeypatch):
    # `train.py -m ckpt_path=<run>/last.ckpt method.optimizer.lr=1e-4,1e-5`: each job continued the
    # checkpoint's run, so their logs merged into one and a later job's steps were dropped.
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    run_id = _first_run(tmp_path / "a", monkeypatch)
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    cfg = compose_train([*FAST, "trainer.max_steps=3", f"ckpt_path={last}"], tmp_path / "b")
    OmegaConf.set_readonly(cfg.hydra, False)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(cfg)
    try:
        _, job = train(cfg)
    finally:  # the next test's config is no sweep's
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.mode = RunMode.RUN
        HydraConfig.instance().set_config(cfg)
    assert job["trainer"].global_step == 3 and job["trainer"].logger.version != run_id
