"""eval.py: a checkpoint and its exported HF folder score the method's own validation metrics."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import REF_SYNC, ROOT, compose_train
from lightning_vlm.evaluation import checkpoint_to_load, evaluate
from lightning_vlm.methods.reference_state import KEY as REFERENCE_KEY
from lightning_vlm.training import train

# Small validation sets: every number below is computed on the same 8 rows.
DATA = ["data.batch_size=4", "data.synthetic.num_val=8", "data.val_batch_size=8"]
COMMON = ["logger=none", "callbacks=none", "trainer.enable_progress_bar=false", *DATA]


def _trained(method_overrides: list[str], out: Path) -> dict[str, float]:
    """Two training steps, validated at step 2, with that step's checkpoint (ckpt/step2.ckpt) and HF
    export (hf/); returns the final (step-2 validation) metrics."""
    overrides = [
        *COMMON, *method_overrides, "trainer.max_steps=2", "trainer.val_check_interval=2",
        "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.ckpt.dirpath={out / 'ckpt'}", "+callbacks.ckpt.filename=step2",
        "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
        f"+callbacks.export.dirpath={out / 'hf'}",
    ]  # fmt: skip
    metrics, _ = train(compose_train(overrides, out))
    return metrics


def _evaluate(overrides: list[str], out: Path) -> dict:
    report, path = evaluate(compose_train([*DATA, *overrides], out, config_name="eval"))
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    return report


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    out = tmp_path_factory.mktemp("sft")
    return out, _trained([], out)


def _val(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("val/")}


def _assert_same(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), name


@pytest.mark.slow  # a real eval.py process
def test_eval_py_scores_the_checkpoint_and_its_exported_folder_the_same(sft_run, tmp_path):
    run, trained = sft_run
    ckpt = run / "ckpt" / "step2.ckpt"
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"ckpt_path={ckpt}", *DATA, f"hydra.run.dir={tmp_path / 'e'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = Path(proc.stdout.strip().splitlines()[-1].rsplit(": ", 1)[1])
    assert printed == tmp_path / "e" / "eval.json"
    report = json.loads(printed.read_text())
    assert report["ckpt_path"] == str(ckpt) and report["num_rows"] == 8
    assert report["data"]["synthetic"]["num_val"] == 8
    # The checkpoint scores what training's validation at that step logged.
    _assert_same(report["metrics"], _val(trained))

    folder = _evaluate([f"model.model_name_or_path={run / 'hf'}"], tmp_path / "hf")
    assert folder["ckpt_path"] is None and folder["model_name_or_path"] == str(run / "hf")
    assert folder["metrics"]["val/answer_accuracy"] == report["metrics"]["val/answer_accuracy"]
    _assert_same(folder["metrics"], report["metrics"])
    # ... and not what the freshly built model scores: the weights evaluated are the trained ones.
    untrained = _evaluate([], tmp_path / "untrained")
    assert untrained["metrics"]["val/loss"] != pytest.approx(report["metrics"]["val/loss"], rel=1e-3)


@pytest.mark.slow  # a real eval.py -m process
def test_an_eval_sweep_summary_ranks_the_jobs_by_their_metric(sft_run, tmp_path):
    # eval.py returned nothing: the summary had empty cells and "no job reported val/answer_accuracy".
    ckpt = sft_run[0] / "ckpt" / "step2.ckpt"
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "-m", f"ckpt_path={ckpt}", *DATA, "optimized_metric=val/loss",
         "method.val_max_new_tokens=2,4", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((sweep / "summary.json").read_text())
    reports = {j["job"]: json.loads((Path(j["dir"]) / "eval.json").read_text()) for j in summary["jobs"]}
    assert len(reports) == 2
    for job in summary["jobs"]:
        assert job["value"] == pytest.approx(reports[job["job"]]["metrics"]["val/loss"])


def _weights(out: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out["module"].vlm.model.named_parameters()}


def test_validate_before_fit_scores_the_checkpoint_and_keeps_the_resume(sft_run, tmp_path):
    run, _ = sft_run
    ckpt = run / "ckpt" / "step2.ckpt"
    resume = [*COMMON, "trainer.max_steps=3", "trainer.val_check_interval=3", f"ckpt_path={ckpt}"]
    _, checked = train(compose_train([*resume, "validate_before_fit=true", "logger=csv"], tmp_path / "a"))
    evaluated = _evaluate([f"ckpt_path={ckpt}"], tmp_path / "eval")
    _assert_same(checked["initial_metrics"], evaluated["metrics"])
    # The loggers get the resumed run's steps only: the checkpoint's scores are not logged at step 0.
    (metrics_csv,) = (tmp_path / "a").rglob("metrics.csv")
    header, *lines = metrics_csv.read_text().splitlines()
    steps = [int(line.split(",")[header.split(",").index("step")]) for line in lines]
    assert steps and 0 not in steps, steps
    # The baseline validation does not disturb the resume: same weights as a plain resumed run.
    _, plain = train(compose_train(resume, tmp_path / "b"))
    assert checked["trainer"].global_step == plain["trainer"].global_step == 3
    a, b = _weights(checked), _weights(plain)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_eval_of_a_dpo_checkpoint_reports_preference_accuracy(sft_run, tmp_path):
    # DPO from the SFT export; evaluated with the same model config, so its reference is that export.
    start = [f"model.model_name_or_path={sft_run[0] / 'hf'}", "method=dpo"]
    trained = _trained(start, tmp_path / "dpo")
    report = _evaluate([*start, f"ckpt_path={tmp_path / 'dpo' / 'ckpt' / 'step2.ckpt'}"], tmp_path / "eval")
    metrics = report["metrics"]
    assert 0.0 <= metrics["val/rewards/accuracies"] <= 1.0
    assert {"val/rewards/chosen", "val/rewards/rejected", "val/answer_accuracy"} <= metrics.keys()
    _assert_same(metrics, _val(trained))
    assert report["task_name"] == "dpo" and report["num_rows"] == 8


def test_eval_of_a_tr_dpo_checkpoint_scores_against_its_synced_reference(sft_run, tmp_path):
    # The reference mixed with the policy after each step (callbacks/reference_sync.py): the checkpoint
    # carries it, and eval (without the callback) scores what training's validation scored, not against
    # the SFT export it would rebuild.
    start = [f"model.model_name_or_path={sft_run[0] / 'hf'}", "method=dpo"]
    trained = _trained([*start, *REF_SYNC], tmp_path / "dpo")
    report = _evaluate([*start, f"ckpt_path={tmp_path / 'dpo' / 'ckpt' / 'step2.ckpt'}"], tmp_path / "eval")
    _assert_same(report["metrics"], _val(trained))
    # The same checkpoint without the moved reference scores against the rebuilt SFT export: other rewards.
    plain = tmp_path / "plain.ckpt"
    checkpoint = torch.load(tmp_path / "dpo" / "ckpt" / "step2.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint.pop(REFERENCE_KEY, None) is not None
    torch.save(checkpoint, plain)
    rebuilt = _evaluate([*start, f"ckpt_path={plain}"], tmp_path / "eval_plain")["metrics"]
    assert abs(rebuilt["val/rewards/margins"] - trained["val/rewards/margins"]) > 1e-3, (rebuilt, trained)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_eval_of_an_hf_folder_warns_that_the_reference_is_the_model_itself(method, sft_run, tmp_path, caplog):
    # Every implicit reward is then 0 (accuracy 0.5 by construction); KTO said nothing.
    with caplog.at_level("WARNING"):
        report = _evaluate([f"model.model_name_or_path={sft_run[0] / 'hf'}", f"method={method}"], tmp_path)
    assert f"Evaluating {method.upper()} without ckpt_path: the reference is" in caplog.text
    assert report["metrics"]["val/rewards/margins" if method == "dpo" else "val/rewards/chosen"] == 0.0


def test_eval_of_an_online_method_reports_each_reward_function(sft_run, tmp_path):
    overrides = [f"model.model_name_or_path={sft_run[0] / 'hf'}", "method=grpo",
                 "method.reward_funcs=[accuracy_reward,think_format_reward]", "method.val_num_generations=2"]  # fmt: skip
    report = _evaluate(overrides, tmp_path)
    metrics = report["metrics"]
    reward, accuracy, think = (metrics[f"val/{k}"] for k in
                               ("reward", "rewards/accuracy_reward", "rewards/think_format_reward"))  # fmt: skip
    # Weights 1 and 1: the mean total reward is the sum of the functions' means.
    assert reward == pytest.approx(accuracy + think, abs=1e-6)
    assert "val/answer_accuracy" in metrics and report["num_rows"] == 8


class _NotATensor:
    """An object a weights_only load must refuse to unpickle."""


def test_checkpoints_load_weights_only_locally(sft_run, tmp_path):
    state = torch.load(sft_run[0] / "ckpt" / "step2.ckpt", weights_only=True)
    state["extra"] = _NotATensor()
    torch.save(state, tmp_path / "unsafe.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _evaluate([f"ckpt_path={tmp_path / 'unsafe.ckpt'}"], tmp_path / "unsafe")

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="URL"):
        checkpoint_to_load("https://example.com/last.ckpt", trainer)
    with pytest.raises(FileNotFoundError):
        checkpoint_to_load(str(tmp_path / "missing.ckpt"), trainer)
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(ValueError, match=r"sharded \(FSDP\).*trainer=fsdp"):
        checkpoint_to_load(str(tmp_path / "sharded.ckpt"), trainer)
    # An FSDP run's last.ckpt folder that ckpt_path=last finds is refused the same way (it was handed to
    # Lightning's DDP/single-device loader as it was)
    (tmp_path / "ckpts" / "last.ckpt").mkdir(parents=True)
    checkpointing = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[checkpointing])
    with pytest.raises(
        ValueError, match=r"ckpt_path='last' found '.*last\.ckpt', which is a folder.*trainer=fsdp"
    ):
        checkpoint_to_load("last", trainer, resuming=True)
    # A run's checkpoints folder, or an HF model folder, is no sharded checkpoint: said so, with what to pass.
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for name in ("last.ckpt", "step_000003.ckpt"):
        (tmp_path / "run" / "checkpoints" / name).touch()
    with pytest.raises(ValueError, match=r"holds the checkpoints last\.ckpt, step_000003\.ckpt: pass one"):
        checkpoint_to_load(str(tmp_path / "run" / "checkpoints"), trainer)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"a Hugging Face model folder: pass it as model\.model_name_or_path"
    ):
        checkpoint_to_load(str(tmp_path / "hf"), trainer)


def test_each_eval_job_of_a_sweep_gets_its_own_wandb_run(sft_run, tmp_path, monkeypatch):
    # eval.py -m runs its jobs in one process; the second job logged into the first one's run.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for seed in (0, 1):
        _evaluate([f"ckpt_path={sft_run[0] / 'ckpt' / 'step2.ckpt'}", "logger=wandb", f"seed={seed}"],
                  tmp_path / str(seed))  # fmt: skip
    runs = [list((tmp_path / str(seed) / "wandb").glob("offline-run-*")) for seed in (0, 1)]
    assert all(len(r) == 1 for r in runs) and runs[0][0].name != runs[1][0].name


def test_a_failed_eval_job_ends_its_wandb_run(sft_run, tmp_path, monkeypatch):
    # The run was ended only after a successful evaluation: the next job of the sweep logged into it.
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="boom in validation"):
        _evaluate([f"ckpt_path={sft_run[0] / 'ckpt' / 'step2.ckpt'}", "logger=wandb",
                   "+callbacks.boom._target_=helpers.RaiseAt"], tmp_path)  # fmt: skip
    assert wandb.run is None


def test_eval_with_the_training_runs_callbacks_scores_the_checkpoint(sft_run, tmp_path):
    # callbacks=default holds a ModelCheckpoint, which Lightning refuses next to eval's
    # enable_checkpointing=false: the flag wins, as it does over a progress bar.
    run, trained = sft_run
    report = _evaluate([f"ckpt_path={run / 'ckpt' / 'step2.ckpt'}", "callbacks=default"], tmp_path)
    _assert_same(report["metrics"], _val(trained))


def test_an_adapter_folder_evaluates_as_its_training_ended(tmp_path):
    # ExportHFModel(merge_lora=false) writes the adapter alone: transformers loads it on its base model
    # (adapter_config.json names it); the scale check read no config there and refused the folder.
    trained = _trained(["lora=default", "+callbacks.export.merge_lora=false"], tmp_path)
    assert (tmp_path / "hf" / "adapter_config.json").is_file()
    report = _evaluate([f"model.model_name_or_path={tmp_path / 'hf'}"], tmp_path / "eval")
    _assert_same(report["metrics"], _val(trained))


def _with_data(ckpt: Path, out: Path, **data) -> Path:
    """``ckpt`` as if trained with other data settings (what eval must compare its own with)."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    checkpoint["datamodule_hyper_parameters"].update(data)
    torch.save(checkpoint, out)
    return out


def test_eval_refuses_to_hold_out_rows_the_checkpoint_trained_on(sft_run, tmp_path):
    # Trained with seed=1 data.val_fraction=0.25 (a seed sweep's job), evaluated without seed=1: eval held
    # out other rows of the same data, half of them rows the checkpoint trained on, and scored them.
    trained = sft_run[0] / "ckpt" / "step2.ckpt"
    synthetic = {
        **torch.load(trained, weights_only=False)["datamodule_hyper_parameters"]["synthetic"],
        "num_train": 40,
    }
    ckpt = _with_data(trained, tmp_path / "seed1.ckpt", seed=1, val_fraction=0.25, synthetic=synthetic)
    held_out = ["data.val_fraction=0.25", "data.synthetic.num_train=40"]
    with pytest.raises(
        ValueError, match=r"data.seed=0.*the checkpoint trained with .*data.seed=1.*seed=1 sets data.seed"
    ):
        _evaluate([f"ckpt_path={ckpt}", *held_out], tmp_path / "a")
    # A checkpoint that trained on every row of data.train has no held-out rows there at all.
    full = _with_data(trained, tmp_path / "full.ckpt", val_fraction=0.0, synthetic=synthetic)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.25.*trained on all of data.train"):
        _evaluate([f"ckpt_path={full}", *held_out], tmp_path / "b")
    # The training run's own split scores (its seed holds out the rows it held out).
    report = _evaluate([f"ckpt_path={ckpt}", *held_out, "seed=1"], tmp_path / "c")
    assert report["num_rows"] == 10
    # A sharded (FSDP) checkpoint is a folder: its entries are in meta.pt, read as the file's are.
    from lightning_vlm.evaluation import check_held_out_rows

    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    torch.save({"datamodule_hyper_parameters": torch.load(ckpt, weights_only=False)["datamodule_hyper_parameters"]},
               sharded / "meta.pt")  # fmt: skip
    data = {**torch.load(ckpt, weights_only=False)["datamodule_hyper_parameters"], "seed": 0}
    with pytest.raises(ValueError, match=r"data.seed=0.*trained with .*data.seed=1"):
        check_held_out_rows(str(sharded), data)
    # Other data (here a larger synthetic set) is not the checkpoint's: nothing to compare.
    assert _evaluate([f"ckpt_path={ckpt}", "data.val_fraction=0.25", "data.synthetic.num_train=60"],
                     tmp_path / "d")["num_rows"] == 15  # fmt: skip


@pytest.mark.parametrize(
    "schedule",
    [
        ["trainer.max_steps=3", "trainer.val_check_interval=2"],
        ["trainer.max_steps=1", "validate_before_fit=true"],
    ],
    ids=["validated-before-the-last-step", "validated-only-before-fit"],
)
def test_the_final_metrics_are_those_of_the_final_weights(schedule, tmp_path):
    # Validated at step 2 of 3 (or only before training): the metric train() hands a sweeper and the
    # exported model card were those of older weights than the folder exported.
    overrides = [*COMMON, *schedule, "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                 f"+callbacks.export.dirpath={tmp_path / 'hf'}"]  # fmt: skip
    metrics, _ = train(compose_train(overrides, tmp_path / "run"))
    exported = _evaluate([f"model.model_name_or_path={tmp_path / 'hf'}"], tmp_path / "eval")
    _assert_same(_val(metrics), exported["metrics"])


@pytest.mark.slow  # a real eval.py process
def test_eval_py_stopped_by_sigterm_exits_143_without_a_report(tmp_path):
    # Lightning ends with a SystemExit without a code: the job exited 0, as if its scores were written.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = tmp_path / "e"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "method=sft", *COMMON, "data.val_batch_size=2",
         "+callbacks.term._target_=_kill9_scenarios.SigTermInValidation", f"hydra.run.dir={run}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Stopped by SIGTERM during the evaluation" in proc.stdout + proc.stderr
    assert not (run / "eval.json").exists()
