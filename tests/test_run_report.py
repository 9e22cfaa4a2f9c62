"""The end-of-run report: curves.png in the run folder (and in W&B), the run's paths as its last lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from PIL import Image

from helpers import compose_train
from lightning_vlm.callbacks.curves import PanelAssigner
from lightning_vlm.callbacks.run_report import RunReport
from lightning_vlm.training import train

SHORT = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
         "data.synthetic.num_val=8", "callbacks.progress_bar.refresh_rate=0"]  # fmt: skip


def _report(trainer) -> RunReport:
    return next(c for c in trainer.callbacks if isinstance(c, RunReport))


def _check_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as image:
        image.verify()  # a whole, valid PNG
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0


def test_exact_names_win_over_patterns_and_empty_panels_are_left_out():
    assigner = PanelAssigner(
        {"reward": ["val/reward", "val/rewards/*"], "accuracy": ["val/rewards/accuracies"]}
    )
    assert assigner.panel_of("val/rewards/accuracy_reward") == "reward"
    assert assigner.panel_of("val/rewards/accuracies") == "accuracy"  # DPO's, named exactly
    assert assigner.panel_of("train/loss") is None
    history = {"val/reward": {2: 0.1}, "val/rewards/accuracy_reward": {2: 0.2}, "train/loss": {1: 3.0}}
    assert assigner.group(history) == {"reward": ["val/reward", "val/rewards/accuracy_reward"]}


def test_history_travels_in_checkpoints(tmp_path):
    panels = {"loss": ["train/loss"]}
    report = RunReport(str(tmp_path), panels)
    report.history = {"train/loss": {1: 2.0, 2: 1.5}}
    torch.save(report.state_dict(), tmp_path / "state.pt")
    resumed = RunReport(str(tmp_path), panels)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))  # as checkpoints load
    assert resumed.history == report.history


def test_sft_run_saves_curves_and_prints_its_paths_last(tmp_path, capsys):
    log_file = tmp_path / "sft.log"
    handler = logging.FileHandler(log_file)  # as Hydra's job logging adds one for <task>.log
    logging.getLogger().addHandler(handler)
    try:
        export = ["+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                  f"+callbacks.export.dirpath={tmp_path / 'model'}"]  # fmt: skip
        _, out = train(compose_train(["logger=csv", *SHORT, *export], tmp_path))
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    report = _report(out["trainer"])
    _check_png(tmp_path / "curves.png")
    assert set(report.drawn) == {"loss", "accuracy"}
    assert {"train/loss", "val/loss"} <= set(report.drawn["loss"])
    assert "val/answer_accuracy" in report.drawn["accuracy"]
    assert sorted(report.history["val/answer_accuracy"]) == [2, 4]  # one point per validation

    checkpoint = out["trainer"].checkpoint_callback
    last = capsys.readouterr().out.strip().splitlines()[-5:]
    assert last[0] == f"Run folder:      {tmp_path.resolve()}"
    assert last[1].startswith(
        f"Best checkpoint: {Path(checkpoint.best_model_path).resolve()} (val/answer_accuracy="
    )
    assert last[2] == f"Last checkpoint: {(tmp_path / 'checkpoints' / 'last.ckpt').resolve()}"
    assert last[3] == f"Exported model:  {(tmp_path / 'model').resolve()}"
    assert last[4] == f"Curves:          {(tmp_path / 'curves.png').resolve()}"
    assert all(line in log_file.read_text() for line in last)


@pytest.mark.slow
def test_wandb_run_gets_the_curves_as_an_image(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _, out = train(compose_train(["logger=wandb", *SHORT], tmp_path))
    (logger,) = out["trainer"].loggers
    assert isinstance(logger, WandbLogger)
    files = Path(logger.experiment.dir)
    logger.experiment.finish()  # the next run in this process must not log into this one
    _check_png(tmp_path / "curves.png")
    images = list((files / "media" / "images").glob("curves_*.png"))
    assert len(images) == 1, sorted(files.rglob("*"))
    _check_png(images[0])


@pytest.mark.slow
def test_grpo_run_draws_its_reward_curve(tmp_path, tiny_path):
    # The random tiny model (no warm start): the curve's shape does not matter here, only that it is drawn.
    overrides = [
        "method=grpo",
        f"model.model_name_or_path={tiny_path('qwen2_5_vl')}",
        "logger=none",
        "~callbacks.lr_monitor",
        *SHORT,
    ]
    _, out = train(compose_train(overrides, tmp_path))
    report = _report(out["trainer"])
    _check_png(tmp_path / "curves.png")
    assert {"train/reward", "val/reward", "val/rewards/accuracy_reward"} <= set(report.drawn["reward"])
    assert "val/answer_accuracy" in report.drawn["accuracy"]
    assert sorted(report.history["train/reward"]) == [1, 2, 3, 4]


def test_a_resumed_run_keeps_every_validation_point_at_its_step(tmp_path):
    # last.ckpt of the last step was written before that step's validation: a finished run resumed with a
    # larger max_steps lost its final point for good. And a baseline validation of the checkpoint
    # (validate_before_fit) was drawn at step 0, where the checkpoint's weights were not.
    short = ["logger=none", "~callbacks.lr_monitor", *SHORT]
    train(compose_train([*short, "trainer.max_steps=2"], tmp_path / "a"))
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    resumed = [*short, "trainer.max_steps=4", f"ckpt_path={last}", "validate_before_fit=true"]
    _, out = train(compose_train(resumed, tmp_path / "b"))
    assert sorted(_report(out["trainer"]).history["val/loss"]) == [2, 4]
