"""``train.py`` on 2 CPU processes as users start it: ``python train.py trainer=ddp ...`` (Lightning's
launcher) exits 0, every method runs under torchrun (one sweep, one process start for all of them), and a
run killed with SIGKILL after a checkpoint resumes to the same weights, bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT, group_options

pytestmark = [pytest.mark.slow, pytest.mark.ddp]
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]


def _env(tmp_path) -> dict:
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    env.pop("WANDB_API_KEY", None)
    env.pop("OMP_NUM_THREADS", None)  # Lightning gives each of the 2 processes 1 thread itself
    return env


def _train_py(args: list[str], tmp_path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, **kwargs,
    )  # fmt: skip


def test_train_py_starts_its_second_process_itself(tmp_path):
    # Lightning's launcher re-runs the command for rank 1; GRPO has the most to keep in step across ranks.
    proc = _train_py([*DDP, "method=grpo", "trainer.max_steps=3"], tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "Final metrics" in out


def _grpo(steps: int, tmp_path, *extra: str) -> list[str]:
    return [*DDP, "method=grpo", "logger=none", "callbacks=none", f"trainer.max_steps={steps}",
            "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "data.batch_size=2",
            "method.num_generations=4", f"hydra.run.dir={tmp_path}",
            "+callbacks.save._target_=ddp_helpers.SaveWeights", f"+callbacks.save.path={tmp_path / 'final.pt'}",
            *extra]  # fmt: skip


def test_a_killed_two_process_run_resumes_to_the_uninterrupted_weights(tmp_path):
    env_path = {"PYTHONPATH": str(ROOT / "tests")}
    os.environ.update(env_path)
    try:
        straight = _train_py(_grpo(12, tmp_path / "straight"), tmp_path)
        assert straight.wait(timeout=600) == 0, straight.stdout.read()[-4000:]
        ckpts = tmp_path / "crash" / "ckpt"
        every = ["+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                 f"+callbacks.ckpt.dirpath={ckpts}", "+callbacks.ckpt.every_n_train_steps=4",
                 "+callbacks.ckpt.save_top_k=-1", "+callbacks.ckpt.filename='step{step}'",
                 "+callbacks.ckpt.auto_insert_metric_name=false"]  # fmt: skip
        crash = _train_py(_grpo(400, tmp_path / "crash", *every), tmp_path, start_new_session=True)
        deadline = time.monotonic() + 600
        # step12 exists, so step8 was written completely; then both processes die at once.
        while not (ckpts / "step12.ckpt").exists():
            assert crash.poll() is None, crash.stdout.read()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(crash.pid, signal.SIGKILL)
        crash.wait(timeout=60)
        assert not (tmp_path / "crash" / "final.pt").exists()
        resumed = _train_py(_grpo(12, tmp_path / "resumed", f"ckpt_path={ckpts / 'step8.ckpt'}"), tmp_path)
        assert resumed.wait(timeout=600) == 0, resumed.stdout.read()[-4000:]
    finally:
        for key in env_path:
            os.environ.pop(key, None)
    a = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


def test_a_sweep_is_refused_when_lightning_would_launch_the_processes(tmp_path):
    proc = _train_py(["-m", *DDP, "method=sft,dpo", "trainer.max_steps=2", "logger=csv"], tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "Hydra multirun (-m) with 2 processes" in out and "torchrun --nproc_per_node=2" in out


def test_a_sweep_under_torchrun_runs_every_method_on_two_processes(tmp_path):
    methods = group_options("method")
    # A small final validation (its values are not read): each rank still runs a batch of it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "-m", *DDP, f"method={','.join(methods)}", "trainer.max_steps=3", "logger=csv",
           "data.synthetic.num_val=8"]  # fmt: skip
    env = {**_env(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # both ranks name the sweep after torchrun's run id, not each its own time stamp
    assert {p.name.split("-")[0] for p in (tmp_path / "logs").glob("*/multiruns/*")} == {"torchrun"}
    assert len({p.name for p in (tmp_path / "logs").glob("*/multiruns/*")}) == 1
    # rank 0 writes one checkpoint folder per job and the sweep's summary: every job completed
    assert len(list((tmp_path / "logs").glob("*/multiruns/*/*/checkpoints/last.ckpt"))) == len(methods)
    (summary,) = (tmp_path / "logs").glob("*/multiruns/*/summary.json")
    jobs = json.loads(summary.read_text())["jobs"]
    assert sorted(o for j in jobs for o in j["overrides"] if o.startswith("method=")) == [
        f"method={m}" for m in methods
    ]
    assert all(j["status"] == "completed" for j in jobs), [j["error"] for j in jobs if j["error"]]


@pytest.mark.parametrize("method", ["sft", "kto"])
def test_eval_py_on_two_processes_scores_each_row_once_as_one_process(method, tmp_path):
    # Lightning's DistributedSampler repeated a row: 7 rows scored as 8, and every metric counted it.
    # KTO gathers each step's rows from every rank (a collective every batch).
    common = [f"method={method}", "logger=none", "data.synthetic.num_val=7", "data.val_batch_size=2",
              "trainer.enable_progress_bar=false"]  # fmt: skip
    reports = {}
    for name, extra in (("one", ["trainer.devices=1", "trainer.accelerator=cpu"]), ("two", DDP)):
        path = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "eval.py"), *common, *extra, f"report_path={path}", f"hydra.run.dir={tmp_path / name}"],
            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        reports[name] = json.loads(path.read_text())
    assert reports["one"]["num_rows"] == reports["two"]["num_rows"] == 7
    one, two = reports["one"]["metrics"], reports["two"]["metrics"]
    assert one.keys() == two.keys()
    for key, value in one.items():
        if method == "kto" and key in ("val/kl", "val/rewards/margins"):
            continue  # KTO's z0 pairs rows within a step: other batch boundaries, other pairs (as in TRL)
        assert two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
