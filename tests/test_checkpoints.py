"""Checkpoints that survive a crash: last.ckpt on a step schedule, atomic writes, weights-only loads.

The faults are real: a write that runs out of disk in the middle of ``torch.save``, and a ``train.py``
process SIGKILLed while it writes ``last.ckpt`` (tests/_checkpoint_probes.py).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import subprocess
import sys
import warnings

import pytest
import torch
from _checkpoint_probes import FaultyCheckpointIO, LastOnDisk, saved_step

from helpers import ROOT, compose_train
from lightning_vlm.checkpoint_io import AtomicCheckpointIO, CheckpointLoadError, stale_temps
from lightning_vlm.training import train

FAST = [
    "logger=none",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.synthetic.num_train=64",  # 16 batches an epoch: every run below stays inside epoch 0
    "data.synthetic.num_val=8",
    "data.val_batch_size=8",
]
CHECKPOINTS_ONLY = [*FAST, "callbacks=model_checkpoint"]


def _weights(out) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out["module"].vlm.model.named_parameters()}


def test_last_ckpt_follows_the_step_schedule_not_the_metric_and_resumes(tmp_path):
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    probe = ["+callbacks.probe._target_=_checkpoint_probes.LastOnDisk", f"+callbacks.probe.path={last}"]
    schedule = ["callbacks.last_checkpoint.every_n_train_steps=2", "trainer.val_check_interval=3"]
    _, out = train(
        compose_train([*CHECKPOINTS_ONLY, *schedule, *probe, "trainer.max_steps=5"], tmp_path / "a")
    )
    (seen,) = [c.seen for c in out["trainer"].callbacks if isinstance(c, LastOnDisk)]
    # Written at steps 2 and 4 (no validation there), not at the validation of step 3 (where the best
    # checkpoint was written), and at the end of fit (step 5).
    assert seen == {0: None, 1: None, 2: 2, 3: 2, 4: 4}
    assert saved_step(last) == 5
    best = out["trainer"].checkpoint_callback
    assert best.monitor == "val/answer_accuracy" and best.best_model_path.endswith("step_000003.ckpt")
    assert saved_step(tmp_path / "a" / "checkpoints" / "step_000003.ckpt") == 3
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt", "step_000003.ckpt"]

    # The end-of-fit last.ckpt continues the run as if it had never stopped.
    more = [*FAST, "callbacks=none", "trainer.val_check_interval=3", "trainer.max_steps=7"]
    _, resumed = train(compose_train([*more, f"ckpt_path={last}"], tmp_path / "b"))
    _, straight = train(compose_train(more, tmp_path / "c"))
    assert resumed["trainer"].global_step == 7
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_write_that_fails_midway_keeps_the_previous_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "checkpoints" / "last.ckpt"
    io = FaultyCheckpointIO(fault_on_save=2, after_bytes=4096, fault="disk_full")
    io.save_checkpoint({"step": 1, "w": torch.ones(10_000)}, target)
    # torch's zip writer reports the OSError from its file as a RuntimeError on the way out.
    with pytest.raises((OSError, RuntimeError)):
        io.save_checkpoint({"step": 2, "w": torch.zeros(10_000)}, target)
    assert io.load_checkpoint(target)["step"] == 1
    # Each write went to a temporary file beside the target (the same filesystem: os.replace is atomic).
    assert [p.parent for p in io.temp_files] == [target.parent] * 2
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_kill_9_while_writing_last_ckpt_leaves_the_previous_one_loadable(tmp_path):
    run = tmp_path / "run"
    # The second write of last.ckpt (step 4) is SIGKILLed after 256 KiB of torch.save's output (of ~5 MB).
    plugin = "{_target_:_checkpoint_probes.FaultyCheckpointIO,fault_on_save:2,after_bytes:262144}"
    args = [*CHECKPOINTS_ONLY, "trainer.max_steps=6", "trainer.limit_val_batches=0",
            "callbacks.last_checkpoint.every_n_train_steps=2", f"trainer.plugins=[{plugin}]",
            f"hydra.run.dir={run}"]  # fmt: skip
    threads = os.environ.get("LIGHTNING_VLM_TEST_THREADS", "2")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": threads}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-4000:]
    last = run / "checkpoints" / "last.ckpt"
    (partial,) = stale_temps(last)  # the killed write's temporary file, beside last.ckpt
    assert partial.stat().st_size >= 262144 and partial.stat().st_size < last.stat().st_size
    state = torch.load(last, weights_only=True)
    assert state["global_step"] == 2 and state["state_dict"] and state["optimizer_states"]
    # The next complete write of last.ckpt removes what the killed one left.
    AtomicCheckpointIO().save_checkpoint(state, last)
    assert stale_temps(last) == [] and saved_step(last) == 2


def test_a_url_ckpt_path_is_refused_before_anything_loads(tmp_path):
    url = "https://example.com/checkpoints/last.ckpt"
    with pytest.raises(ValueError, match=r"ckpt_path='https://example\.com/checkpoints/last\.ckpt' is a URL"):
        train(compose_train([*FAST, "callbacks=none", f"ckpt_path={url}"], tmp_path))


def _load_error(ckpt, tmp_path) -> BaseException:
    with pytest.raises(ValueError) as info:
        train(compose_train([*FAST, "callbacks=none", "trainer.max_steps=1", f"ckpt_path={ckpt}"], tmp_path))
    return info.value


def test_random_bytes_and_truncated_files_are_refused_naming_ckpt_path(tmp_path):
    noise = tmp_path / "noise.ckpt"
    # Fixed bytes: random ones fail in the weights-only unpickler's refusal or, read as a legacy
    # pickle, in whatever it trips on (a KeyError); both must come out as the same clear error.
    noise.write_bytes(random.Random(0).randbytes(65536))
    err = _load_error(noise, tmp_path / "a")
    assert isinstance(err, CheckpointLoadError) and f"ckpt_path={str(noise)!r}" in str(err)
    # torch's own text suggests loading with weights_only=False (running the file's code): not passed on.
    assert "weights_only=False" not in str(err) and "weights_only` set to `False" not in str(err)
    pickled = tmp_path / "code.ckpt"
    pickled.write_bytes(pickle.dumps(os.system, protocol=2))  # a pickle that would call a function
    err = _load_error(pickled, tmp_path / "c")
    assert isinstance(err, CheckpointLoadError) and "Weights only load failed" in str(err)
    assert "weights_only=False" not in str(err) and "weights_only` set to `False" not in str(err)
    assert err.__cause__ is None and err.__suppress_context__

    whole = tmp_path / "whole.ckpt"
    torch.save({"w": torch.ones(10_000)}, whole)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    err = _load_error(cut, tmp_path / "b")
    assert isinstance(err, CheckpointLoadError) and f"ckpt_path={str(cut)!r}" in str(err)
    assert "truncated" in str(err)


def test_a_dpo_checkpoint_given_to_sft_names_ckpt_path(tmp_path):
    # DPO from the random tiny model (no warm start needed): one step, its last.ckpt at the end of fit.
    dpo = ["method=dpo", "tiny_start=random", "trainer.max_steps=1", "trainer.limit_val_batches=0"]
    train(compose_train([*CHECKPOINTS_ONLY, *dpo], tmp_path / "dpo"))
    ckpt = tmp_path / "dpo" / "checkpoints" / "last.ckpt"
    err = _load_error(ckpt, tmp_path / "sft")
    assert f"ckpt_path={str(ckpt)!r} was written by DPO, and this run's method is SFT" in str(err)
    assert "method=" in str(err)
    # A checkpoint without that record (written before it existed) is refused by its weights, as before.
    state = torch.load(ckpt, weights_only=True)
    del state["lightning_vlm/run_identity"]
    torch.save(state, ckpt)
    err = _load_error(ckpt, tmp_path / "sft_old")
    assert f"ckpt_path={str(ckpt)!r} does not fit this run's SFT module" in str(err)
    assert "Unexpected key(s)" in str(err) and "method=" in str(err)


def test_ckpt_path_last_is_taken_only_where_a_last_checkpoint_exists(tmp_path, caplog):
    # A run pinned to a folder that holds last.ckpt (hydra.run.dir=...) may resume with Lightning's
    # keyword. Without one, eval.py would score the initial weights (refused); a training run starts
    # from them, saying so (a requeued job's first start).
    import lightning as L

    from lightning_vlm.callbacks.last_checkpoint import LastCheckpoint
    from lightning_vlm.ckpt_path import checkpoint_to_load

    # The best and the last checkpoints share a folder, named once
    callbacks = [LastCheckpoint(dirpath=tmp_path), L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path)]
    trainer = L.Trainer(logger=False, callbacks=callbacks, enable_progress_bar=False)
    with pytest.raises(FileNotFoundError, match="ckpt_path=last: Lightning looks in this run's own"):
        checkpoint_to_load("last", trainer)
    assert checkpoint_to_load("last", trainer, resuming=True) is None
    assert "training starts from the initial weights" in caplog.text
    assert f"no last.ckpt in {tmp_path}, so training" in caplog.text
    with pytest.raises(FileNotFoundError, match="ckpt_path=best"):
        checkpoint_to_load("best", trainer, resuming=True)
    (tmp_path / "last.ckpt").write_bytes(b"")
    found = str(tmp_path / "last.ckpt")  # the file itself, from which train.py also reads the W&B run id
    assert checkpoint_to_load("last", trainer) == checkpoint_to_load("last", trainer, resuming=True) == found
    assert checkpoint_to_load("hpc", trainer) == "hpc"  # SLURM's, resolved by Lightning in default_root_dir


def test_a_requeued_run_with_another_schedule_keeps_writing_last_ckpt(tmp_path):
    # Lightning keys a ModelCheckpoint's state by its settings: with another every_n_train_steps, the
    # resumed run wrote last-v1.ckpt, and every later `ckpt_path=last` went back to the old last.ckpt.
    checkpoints = tmp_path / "checkpoints"
    for steps, every in ((4, 2), (6, 3), (9, 3)):
        run = [*CHECKPOINTS_ONLY, "~callbacks.model_checkpoint", "trainer.limit_val_batches=0", "ckpt_path=last",
               f"trainer.max_steps={steps}", f"callbacks.last_checkpoint.every_n_train_steps={every}"]  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, out = train(compose_train(run, tmp_path))
        assert not [
            w for w in caught if "holds an earlier run's state" in str(w.message)
        ]  # resumes are quiet
        assert out["trainer"].global_step == steps
        assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
        assert saved_step(checkpoints / "last.ckpt") == steps
    # A run resuming nothing in that folder replaces the earlier last.ckpt: it says so first.
    fresh = [
        *CHECKPOINTS_ONLY,
        "~callbacks.model_checkpoint",
        "trainer.limit_val_batches=0",
        "trainer.max_steps=1",
    ]
    with pytest.warns(UserWarning, match="holds an earlier run's state, which this run .* replaces"):
        train(compose_train(fresh, tmp_path))


def test_an_earlier_sharded_last_ckpt_folder_is_named_before_it_is_replaced(tmp_path, monkeypatch):
    # FSDP's sharded last.ckpt is a folder, which the check for an earlier run's file passed over.
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_vlm.callbacks.last_checkpoint import LastCheckpoint

    (tmp_path / "last.ckpt").mkdir()
    monkeypatch.setattr(ModelCheckpoint, "on_train_start", lambda *args: None)  # needs a whole Trainer
    with pytest.warns(UserWarning, match="last.ckpt holds an earlier run's state"):
        LastCheckpoint(dirpath=tmp_path).on_train_start(SimpleNamespace(global_step=0, ckpt_path=None), None)


def test_a_checkpoint_resumed_with_other_parameters_trained_names_ckpt_path(tmp_path):
    # Its optimizer groups no longer fit: torch's bare "parameter group that doesn't match the size".
    run = [
        *CHECKPOINTS_ONLY,
        "trainer.max_steps=1",
        "trainer.limit_val_batches=0",
        "model.freeze_vision_tower=true",
    ]
    train(compose_train(run, tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    resume = [*CHECKPOINTS_ONLY, "trainer.max_steps=2", "trainer.limit_val_batches=0", f"ckpt_path={ckpt}"]
    with pytest.raises(
        ValueError, match=rf"ckpt_path={re.escape(repr(str(ckpt)))} does not fit .*freeze_vision_tower"
    ):
        train(compose_train(resume, tmp_path / "b"))


def test_a_crash_during_a_validation_reruns_it_on_resume(tmp_path):
    # last.ckpt was written at the batch end before the validation of its step: Lightning reads such a
    # checkpoint as "validation done" and skipped it on resume (and the best checkpoint of that step).
    from _checkpoint_probes import ValidationSteps

    run = [*CHECKPOINTS_ONLY, "data.synthetic.num_val=8", "data.val_batch_size=4", "trainer.max_steps=4",
           "trainer.val_check_interval=2", "callbacks.last_checkpoint.every_n_train_steps=2",
           "+callbacks.steps._target_=_checkpoint_probes.ValidationSteps"]  # fmt: skip
    crash = ["+callbacks.crash._target_=_checkpoint_probes.CrashInValidation", "+callbacks.crash.at_step=2"]
    with pytest.raises(RuntimeError, match="crash in the validation of step 2"):
        train(compose_train([*run, *crash], tmp_path))
    _, out = train(compose_train([*run, "ckpt_path=last"], tmp_path))
    (steps,) = [c for c in out["trainer"].callbacks if isinstance(c, ValidationSteps)]
    assert out["trainer"].global_step == 4 and steps.seen == [2, 4]
    assert saved_step(tmp_path / "checkpoints" / "last.ckpt") == 4


def test_a_run_without_validation_rows_keeps_its_last_ckpt_schedule(tmp_path):
    # A save due at a validation step waits for that validation; without validation rows none runs (nor
    # its end hook): the save must still happen, not wait for good.
    import json

    row = {"messages": [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "red"}]}
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for _ in range(32)))
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    run = [*CHECKPOINTS_ONLY, "~callbacks.model_checkpoint", f"data.train={tmp_path / 'train.jsonl'}",
           "trainer.val_check_interval=2", "callbacks.last_checkpoint.every_n_train_steps=2", "trainer.max_steps=5",
           "+callbacks.probe._target_=_checkpoint_probes.LastOnDisk", f"+callbacks.probe.path={last}"]  # fmt: skip
    _, out = train(compose_train(run, tmp_path / "a"))
    (seen,) = [c.seen for c in out["trainer"].callbacks if isinstance(c, LastOnDisk)]
    assert seen[3] == 2 and seen[5 - 1] == 4
