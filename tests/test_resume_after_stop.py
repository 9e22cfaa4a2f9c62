"""A fit stopped early mid-epoch (``max_time``, early stopping, any callback setting ``should_stop``)
leaves a ``last.ckpt`` that resumes where it stopped, in the same epoch, to the uninterrupted run's
weights. It used to resume at the next epoch: Lightning closes the epoch before ``on_train_end``, where
``last.ckpt`` was written, so the rest of the stopped epoch's data was never trained on."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from helpers import compose_train
from lightning_vlm.training import train

COMMON = ["logger=none", "callbacks=model_checkpoint", "~callbacks.model_checkpoint",
          "callbacks.last_checkpoint.every_n_train_steps=1000", "trainer.enable_progress_bar=false",
          "data.batch_size=4", "data.synthetic.num_train=32", "data.synthetic.num_val=4", "seed=0",
          "trainer.max_steps=6"]  # fmt: skip  # 8 batches an epoch: a stop at step 3 is mid-epoch


class StopAt(L.Callback):
    """Sets ``trainer.should_stop`` in ``hook`` after training batch ``at_batch`` (0-based, counted over
    the fit), as Lightning's Timer (a train batch's end) or EarlyStopping (a validation's end) do."""

    def __init__(self, at_batch: int, hook: str) -> None:
        self.at_batch, self.hook = at_batch, hook

    def _maybe_stop(self, trainer: L.Trainer) -> None:
        if trainer.fit_loop.epoch_loop.total_batch_idx == self.at_batch and not trainer.sanity_checking:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if self.hook == "train_batch_end":
            self._maybe_stop(trainer)

    def on_validation_end(self, trainer: L.Trainer, *args) -> None:
        if self.hook == "validation_end":
            self._maybe_stop(trainer)


def _weights(out) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out["module"].vlm.model.named_parameters()}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("hook", ["train_batch_end", "validation_end"])
def test_a_fit_stopped_mid_epoch_resumes_in_that_epoch(tmp_path, hook, accumulate):
    # Validation every batch, so that a validation's end falls mid-epoch, as with val_check_interval.
    # With 2 batches a step the stop is asked for after batch 4, the first of an accumulation: the stop
    # used to drop its gradients while the checkpoint counted its rows as trained on. It now waits for
    # the accumulation's optimizer step (step 3, as with 1 batch a step).
    common = [*COMMON, "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
              f"trainer.accumulate_grad_batches={accumulate}"]  # fmt: skip
    _, straight = train(compose_train(common, tmp_path / "straight"))
    stop = ["+callbacks.stop._target_=test_resume_after_stop.StopAt", f"+callbacks.stop.at_batch={2 * accumulate}",
            f"+callbacks.stop.hook={hook}"]  # fmt: skip
    _, stopped = train(compose_train([*common, *stop], tmp_path / "stopped"))
    assert stopped["trainer"].global_step == 3
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3 and saved["epoch"] == 0
    _, resumed = train(compose_train([*common, f"ckpt_path={last}"], tmp_path / "resumed"))
    assert resumed["trainer"].global_step == 6
    assert resumed["trainer"].current_epoch == straight["trainer"].current_epoch
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_stop_refused_before_min_steps_does_not_save_every_step(tmp_path, monkeypatch):
    # Lightning keeps should_stop set and goes on until min_steps: last.ckpt was then written every step.
    from lightning_vlm.callbacks.last_checkpoint import LastCheckpoint

    saved = []
    original = LastCheckpoint._save_last_checkpoint

    def counting(self, trainer, *args):
        saved.append(trainer.global_step)
        return original(self, trainer, *args)

    monkeypatch.setattr(LastCheckpoint, "_save_last_checkpoint", counting)
    stop = ["+callbacks.stop._target_=test_resume_after_stop.StopAt", "+callbacks.stop.at_batch=1",
            "+callbacks.stop.hook=train_batch_end", "+trainer.min_steps=5", "trainer.limit_val_batches=0",
            "trainer.max_steps=8"]  # fmt: skip
    _, out = train(compose_train([*COMMON, *stop], tmp_path))
    # Lightning 2.6 does not stop for a request it refused (it trains on to max_steps); last.ckpt is then
    # written at the end only, where it was written at every step from 2 on.
    assert out["trainer"].global_step == 8
    assert saved == [8]


def test_trainer_max_time_as_the_readme_writes_it_stops_fit_and_saves_last(tmp_path):
    # The README names `trainer.max_time` for a wall-clock budget; it was not in conf/trainer/default.yaml,
    # so Hydra refused the override ("Key 'max_time' is not in struct").
    budget = ["trainer.max_time=00:00:00:01", "trainer.max_steps=100000", "trainer.limit_val_batches=0"]
    _, out = train(compose_train([*COMMON[:-1], *budget], tmp_path))
    step = out["trainer"].global_step
    assert 0 < step < 100000
    last = tmp_path / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == step
    # Resumed with the same budget, Lightning (which counts the time across resumes) stopped before the
    # first step and the run exited 0, having trained nothing: refused, naming the setting.
    with pytest.raises(ValueError, match=r"trainer.max_time=0:00:01 .* raise trainer.max_time to train on"):
        train(compose_train([*COMMON[:-1], *budget, f"ckpt_path={last}"], tmp_path / "same_budget"))
    more = ["trainer.max_time=00:01:00:00", f"trainer.max_steps={step + 2}", "trainer.limit_val_batches=0"]
    _, out = train(compose_train([*COMMON[:-1], *more, f"ckpt_path={last}"], tmp_path / "more_time"))
    assert out["trainer"].global_step == step + 2


def test_sigterm_at_a_batch_a_validation_follows_saves_before_validating(tmp_path):
    # Lightning ran a validation batch (for online methods, generations) before it stopped, while a
    # scheduler's grace period ran; the state saved is the same (that batch trained, the validation skipped).
    common = [*COMMON, "trainer.val_check_interval=3", "trainer.limit_val_batches=1"]
    batches = tmp_path / "validation_batches.txt"
    count = [
        "+callbacks.count._target_=_kill9_scenarios.ValidationBatches",
        f"+callbacks.count.path={batches}",
    ]
    term = ["+callbacks.term._target_=_kill9_scenarios.SigTerm", "+callbacks.term.at_step=3"]
    with pytest.raises(SystemExit) as stopped:
        train(compose_train([*common, *count, *term], tmp_path / "stopped"))
    assert stopped.value.code == 143
    assert batches.read_text() == ""
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 3
    # The resume trains on to the straight run's weights; step 3's validation stays skipped, as after a
    # SIGTERM during it (callbacks/last_checkpoint.py).
    _, straight = train(compose_train(common, tmp_path / "straight"))
    _, resumed = train(compose_train([*common, *count, f"ckpt_path={last}"], tmp_path / "resumed"))
    assert batches.read_text().split() == ["6"]
    a, b = _weights(straight), _weights(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("max_steps", [10, -1])
def test_max_steps_ending_a_run_given_max_epochs_is_said(max_steps, tmp_path, caplog):
    # Every method's config sets trainer.max_steps: trainer.max_epochs=3 (TRL's num_train_epochs) stopped
    # at the step limit, part-way through the epochs, without a word.
    epochs = ["trainer.max_epochs=3", f"trainer.max_steps={max_steps}", "trainer.limit_val_batches=0"]
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        _, out = train(compose_train([*COMMON[:-1], *epochs], tmp_path))
    per_epoch = out["trainer"].num_training_batches
    if max_steps == 10:
        assert per_epoch < 10 < 3 * per_epoch and out["trainer"].global_step == 10
        assert "trainer.max_steps=10 ended the run in epoch 2 of trainer.max_epochs=3" in caplog.text
        assert "set trainer.max_steps=-1 to train by epochs" in caplog.text
    else:
        assert out["trainer"].global_step == 3 * per_epoch and "ended the run" not in caplog.text
