"""train.py end to end: the real entry point, as a user runs it, on the tiny default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, group_options


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


def test_help_lists_the_options_to_choose_not_the_partials_they_build_on(tmp_path):
    # Hydra's own list showed method=_online, model=_tiny, data=_base and the internal scale/schema groups.
    proc = _run(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    lines = dict(line.split(": ", 1) for line in groups.splitlines() if ": " in line)
    assert lines["method"].split(", ") == group_options("method")
    assert "qwen2_5_vl" in lines["model"] and "_" + "tiny" not in lines["model"]
    assert not {"scale", "schema", "hydra", "paths"} & lines.keys() and "_" + "base" not in lines["data"]
    assert "task_name: sft" in proc.stdout  # the composed config follows


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
    # What a newcomer's first run printed that says nothing about it: wandb's deprecation of the anonymous
    # setting Lightning passes, and torch's of the LeafSpec Lightning builds.
    assert "anonymous" not in proc.stderr + proc.stdout and "LeafSpec" not in proc.stderr + proc.stdout


METHODS = ["sft", "dpo", "mpo", "kto", "grpo", "gspo", "dapo", "rloo", "online_dpo"]


@pytest.mark.slow
def test_train_py_runs_two_steps_of_every_method_in_one_sweep_and_exits_0(tmp_path):
    # Each job ends before its first validation (val_check_interval 100): it validates its final weights
    # once, so the sweep summary gets every job's metric.
    proc = _run(["-m", f"method={','.join(METHODS)}", "trainer.max_steps=2", "data.synthetic.num_val=8",
                 "data.val_batch_size=8", "logger=csv"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted((tmp_path / "logs").glob("*/multiruns/*/[0-9]*"))
    assert len(jobs) == len(METHODS)
    assert all((job / "checkpoints" / "last.ckpt").is_file() for job in jobs)
    overrides = "".join((job / ".hydra" / "overrides.yaml").read_text() for job in jobs)
    assert all(f"method={m}" in overrides for m in METHODS)
    # one summary for the sweep (in the base config's sweep folder): every job, its metric, the best
    (summary_file,) = (tmp_path / "logs").glob("*/multiruns/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert len(summary["jobs"]) == len(METHODS) and all(j["status"] == "completed" for j in summary["jobs"])
    assert all(isinstance(j["value"], float) for j in summary["jobs"])  # each job validated its weights
    # each method optimises its own metric: no job is best over all, each metric has its best
    assert summary["best"] is None and len(summary["best_per_metric"]) == 3
    for metric, best in summary["best_per_metric"].items():
        assert best["value"] == max(j["value"] for j in summary["jobs"] if j["metric"] == metric)
    assert "| job | metric | value |" in (summary_file.parent / "summary.md").read_text()
    assert "Sweep best" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_a_sweep_with_a_failed_job_still_writes_the_summary_of_every_job(tmp_path):
    # Hydra's basic sweeper re-raises the failed job's error before the multirun's end: the summary
    # written after each job is what is left, the failure with its error.
    proc = _run(["-m", "data.batch_size=4,0", "trainer.max_steps=2", "data.synthetic.num_val=8",
                 "logger=csv"], tmp_path)  # fmt: skip
    assert proc.returncode != 0
    (summary_file,) = (tmp_path / "logs").glob("*/multiruns/*/summary.json")
    jobs = json.loads(summary_file.read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "failed"]
    assert "data.batch_size must be a whole number > 0" in jobs[1]["error"]
    assert "| failed |" in (summary_file.parent / "summary.md").read_text()
    assert not (tmp_path / "logs" / "sft" / "runs").exists()  # a sweep claims its sweep folder, no run folder


@pytest.mark.slow
def test_optuna_sweep_runs_trials_and_writes_its_summary(tmp_path):
    proc = _run(["-m", "hparams_search=sft_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2",
                 "trainer.max_steps=2", "data.synthetic.num_val=8", "data.synthetic.num_train=64"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (sweep,) = (tmp_path / "logs" / "sft" / "multiruns").iterdir()
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["metric"] == "val/answer_accuracy" and len(summary["jobs"]) == 2
    lrs = [next(o for o in j["overrides"] if o.startswith("method.optimizer.lr=")) for j in summary["jobs"]]
    assert len(set(lrs)) == 2  # Optuna sampled two learning rates
    results = (sweep / "optimization_results.yaml").read_text()  # the plugin's own record
    assert "best_value" in results and summary["best"] is not None


@pytest.mark.slow
def test_train_py_on_a_data_file_without_validation_and_without_a_progress_bar_exits_0(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "red.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": ["red.png"]}  # fmt: skip
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for _ in range(8)))
    proc = _run([f"data.train={tmp_path / 'train.jsonl'}", "data.batch_size=4", "trainer.max_steps=2",
                 "trainer.enable_progress_bar=false", "logger=csv"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr  # Hydra's console log handler writes to stdout
    assert "was not logged (no validation ran)" in output
    assert "validating the final weights" not in output  # there are no validation rows to validate on
    # Said before the run's last lines (the report), not after them.
    assert proc.stdout.index("was not logged (no validation ran)") < proc.stdout.index("Run folder:")
    assert "Epoch 0:" not in output  # no progress bar
    assert "Tip:" not in output  # Lightning's advertisements for its hosted services
    assert next((tmp_path / "logs" / "sft" / "runs").iterdir()).joinpath("checkpoints", "last.ckpt").is_file()
    assert not (tmp_path / "logs" / "sft" / "multiruns").exists()  # a single run is no sweep: no summary
