"""A ``train.py`` run killed with SIGKILL resumes from its ``last.ckpt`` to the uninterrupted run's state,
bitwise: every weight, every optimizer tensor, the loops and the data position.

For SFT, DPO and GRPO (HF generate, and colocated vLLM) a real ``kill -9`` hits the run (tests/
_kill9_scenarios.py): at a random optimizer step between two ``last.ckpt`` writes, so the resume starts
from a mid-epoch checkpoint and redoes the steps the killed run had done since (for GRPO also between the
two optimizer steps of one generation), and right after the write on the last batch of an epoch. SFT is
budgeted in epochs, and its epoch-boundary resume is killed again mid-epoch and resumed once more. The
kill steps are drawn with an RNG seeded by ``LIGHTNING_VLM_KILL_SEED`` (default 0) and printed. A kill
*during* a checkpoint write is tests/test_checkpoints.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("_kill9_scenarios.py")
NAMES = [pytest.param("sft"), pytest.param("dpo"), pytest.param("grpo"),
         pytest.param("grpo_vllm", marks=pytest.mark.vllm)]  # fmt: skip
BATCHES_PER_EPOCH = 4  # _kill9_scenarios.BATCHES_PER_EPOCH (not imported: it imports lightning)
# What must match the uninterrupted run exactly: the training state a checkpoint holds.
COMPARED = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch")


@pytest.fixture(scope="module")
def report(request, sft_warm_start, tmp_path_factory) -> dict:
    """Runs the scenarios this session selected in one subprocess (which starts the killed train.py runs)
    and returns its JSON report."""
    here = [i for i in request.session.items if getattr(i, "module", None) is sys.modules[__name__]]
    names = sorted({i.callspec.params["name"] for i in here if hasattr(i, "callspec")})
    if set(names) - {"sft"}:
        sft_warm_start()  # DPO and GRPO start from it: built here, once, so the runs only read the cache
    out = tmp_path_factory.mktemp("kill9")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), str(out / "report.json"), str(out / "runs"), *names]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if not (out / "report.json").is_file():
        pytest.fail(f"kill -9 scenarios failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    report = json.loads((out / "report.json").read_text())
    for name, section in report.items():  # where the matrix spends its time (shown with -s)
        runs = {k: v.get("seconds") for k, v in section["runs"].items()}
        kills = {k: [x.get("seconds") for x in v] for k, v in section["kills"].items() if isinstance(v, list)}
        print(f"{name}: in-process runs {runs} s, killed train.py runs {kills} s")
    return report


def _section(report: dict, name: str) -> dict:
    section = report[name]
    for run in section["runs"].values():
        # seconds, or the run's error
        assert not isinstance(run.get("seconds"), dict), run["seconds"]["traceback"]
    for kills in section["kills"].values():
        assert isinstance(kills, list), kills.get("traceback", kills)
    return section


def _load(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _leaves(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}/{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}/{i}")
    else:
        yield prefix, value


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _assert_resumed_matches_straight(section: dict, point: str, saved: dict) -> None:
    straight = _load(Path(section["runs"]["straight"]["dir"]) / "checkpoints" / "last.ckpt")
    resumed = _load(Path(section["runs"][point]["dir"]) / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == straight["global_step"] == section["scenario"]["max_steps"]
    for key in COMPARED:
        a, b = dict(_leaves(straight[key], key)), dict(_leaves(resumed[key], key))
        assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:10]
        differ = [k for k in a if not _same(a[k], b[k])]
        assert not differ, f"{len(differ)} of {len(a)} differ from the uninterrupted run: {differ[:8]}"
    # Not a vacuous match: the weights moved after the checkpoint the resume started from.
    moved = [k for k, v in saved["state_dict"].items() if not torch.equal(v, straight["state_dict"][k])]
    assert moved, "no weight changed after the checkpoint: the comparison proves nothing"


def _killed(kill: dict, vllm: bool) -> dict:
    """The killed run's last.ckpt, once its death is checked to be the SIGKILL, where it was planned."""
    assert kill["returncode"] == -signal.SIGKILL, kill["log_tail"]
    assert kill["marker"] is not None, kill["log_tail"]
    assert ("vLLM colocate generator ready" in Path(kill["dir"], "train.log").read_text()) == vllm
    return _load(Path(kill["dir"]) / "checkpoints" / "last.ckpt")


def _position(ckpt: dict) -> dict:
    return ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]


@pytest.mark.parametrize("name", NAMES)
def test_kill_9_at_a_random_step_between_checkpoints_resumes_bitwise(report, name):
    section = _section(report, name)
    scenario, (plan,), (kill,) = section["scenario"], section["chains"]["random"], section["kills"]["random"]
    step, every = plan["at_step"], scenario["every"]
    print(f"{name}: SIGKILL at optimizer step {step} ({kill['marker']['where']}), "
          f"LIGHTNING_VLM_KILL_SEED={os.environ.get('LIGHTNING_VLM_KILL_SEED', '0')}")  # fmt: skip
    saved = _killed(kill, vllm=name.endswith("vllm"))
    assert kill["marker"]["global_step"] == step
    # Resumed from the write before the kill, mid-epoch: the steps after it are redone, from mid-epoch data.
    assert saved["global_step"] == step // every * every < step
    assert 0 < _position(saved)["batches"] < BATCHES_PER_EPOCH
    _assert_resumed_matches_straight(section, "random", saved)


@pytest.mark.parametrize("name", NAMES)
def test_kill_9_right_after_the_checkpoint_on_an_epochs_last_batch_resumes_bitwise(report, name):
    section = _section(report, name)
    scenario, kills = section["scenario"], section["kills"]["epoch"]
    assert len(kills) == len(section["chains"]["epoch"])
    first = _killed(kills[0], vllm=name.endswith("vllm"))
    assert kills[0]["marker"] == {"global_step": scenario["epoch_steps"], "epoch": 0, "where": "epoch_end"}
    assert first["global_step"] == scenario["epoch_steps"]
    assert _position(first)["epoch"] == 0 and _position(first)["batches"] == BATCHES_PER_EPOCH
    saved = first
    if scenario["epoch_budget"]:
        # The epoch-boundary resume, itself killed mid-epoch 1 (a preempted job preempted again).
        step, every = section["chains"]["epoch"][1]["at_step"], scenario["every"]
        print(f"{name}: resumed run SIGKILLed again at optimizer step {step}")
        saved = _killed(kills[1], vllm=False)
        assert saved["global_step"] == step // every * every < step
        assert _position(saved)["epoch"] == 1 and 0 < _position(saved)["batches"] < BATCHES_PER_EPOCH
    _assert_resumed_matches_straight(section, "epoch", saved)
