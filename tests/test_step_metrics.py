"""Step metrics under gradient accumulation: one optimizer step's micro-batches together, as TRL logs them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ddp_helpers import COMMON

from helpers import compose_train
from lightning_vlm.callbacks.run_report import RunReport
from lightning_vlm.methods.step_window import StepWindow
from lightning_vlm.training import train


def test_the_window_weighs_micro_batches_and_restarts_at_the_next_step():
    window = StepWindow()
    assert window.update(0, {"a": torch.tensor(1.0)}, 2) == {"a": 1.0}
    # (1·2 + 4·1) / 3; a mean over no items (NaN, weight 0) and a zero weight add nothing
    step = window.update(0, {"a": torch.tensor(4.0), "b": torch.tensor(float("nan"))}, {"a": 1, "b": 0})
    assert step == {"a": 2.0}  # "b" has no items yet: left out
    assert window.update(0, {"a": torch.tensor(9.0)}, 0) == {"a": 2.0}
    # a NaN over items (a diverged loss) is shown, not hidden
    assert window.update(0, {"a": torch.tensor(float("nan"))}, 1)["a"].isnan()
    assert window.update(1, {"a": torch.tensor(5.0)}, 1) == {"a": 5.0}  # the next window starts afresh


def test_the_curves_take_a_step_s_value_after_its_last_micro_batch(tmp_path):
    report = RunReport(str(tmp_path), {"loss": ["train/loss"]})
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, callback_metrics={})
    report.on_train_start(trainer, None)
    # (global step after the batch, the loss it logged): 2 micro-batches a step, the second the step's mean
    for step, loss in [(0, 9.0), (1, 5.0), (1, 8.0), (2, 4.0)]:
        trainer.global_step, trainer.callback_metrics = step, {"train/loss": torch.tensor(loss)}
        report.on_train_batch_end(trainer, None, None, None, 0)
    assert report.history == {"train/loss": {1: 5.0, 2: 4.0}}


# Metrics over pairs of rows (KTO's ranking accuracy) pair rows inside a micro-batch only: TRL's too.
WITHIN_MICRO_BATCH = {"train/rewards/accuracies"}


@pytest.mark.parametrize(
    "method",
    [
        ["method=sft"],
        ["method=dpo"],
        # MPO without bco_pair, whose running δ moves between micro-batches (TRL's RunningMoments too)
        ["method=mpo", "method.loss_type=[sigmoid,sft]", "method.loss_weights=[0.8,1.0]"],
        ["method=kto", "method.loss_type=apo_zero_unpaired"],
    ],
)
def test_two_accumulated_micro_batches_log_what_one_batch_logs(method, tmp_path):
    base = [*COMMON, *method, "trainer.max_steps=2"]
    whole, _ = train(compose_train([*base, "data.batch_size=4"], tmp_path / "whole"))
    parts, _ = train(compose_train([*base, "data.batch_size=2", "trainer.accumulate_grad_batches=2"],
                                   tmp_path / "parts"))  # fmt: skip
    step = {k: v for k, v in whole.items() if k.startswith("train/") and k not in WITHIN_MICRO_BATCH}
    assert "train/loss" in step, sorted(whole)
    assert step.keys() <= parts.keys(), sorted(step.keys() - parts.keys())
    for key, value in step.items():
        # float noise only: the same rows, padded in batches of other shapes
        assert parts[key] == pytest.approx(float(value), rel=1e-3, abs=1e-5), key


def test_tied_groups_are_the_groups_the_zero_std_filter_drops():
    from lightning_vlm.methods.dynamic_sampling import zero_std_filter
    from lightning_vlm.methods.online_metrics import tied_groups

    nan = float("nan")
    # a tie with one None reward (its advantages are all 0), spread, all None, one valid reward
    grouped = torch.tensor([[1, 1, nan, 1], [0, 1, nan, 1], [nan] * 4, [2, nan, nan, nan]])
    assert tied_groups(grouped).tolist() == [True, False, True, True]  # the first read as spread before
    torch.manual_seed(0)
    for _ in range(200):
        group = torch.randint(0, 3, (4,)).float().masked_fill(torch.rand(4) < 0.3, nan)
        assert bool(tied_groups(group[None])[0]) is not zero_std_filter(group, group[:, None])


def test_a_diverged_step_s_nan_loss_is_logged_and_an_undescribed_stat_is_left_out():
    # step_value averaged the steps with a value, which was meant for Online DPO's stats of a step of ties
    # (NaN: nothing to describe) but took the loss too: a generation whose last step diverged logged the
    # loss of the one before.
    from lightning_vlm.methods.online_metrics import stat_weights, step_value

    nan = torch.tensor(float("nan"))
    assert step_value("loss", [torch.tensor(0.3), nan]).isnan()
    assert step_value("rewards/margins", [torch.tensor(0.3), nan]) == pytest.approx(0.3)
    # a micro-batch whose completions are all masked weighs nothing in its step's stats; a step with
    # none left is NaN (left out above)
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 0]])
    assert stat_weights(mask, [torch.tensor([0]), torch.tensor([1]), torch.tensor([2, 3])]) == [0.5, 0.0, 0.5]
    assert all(w != w for w in stat_weights(mask, [torch.tensor([1]), torch.tensor([3])]))
