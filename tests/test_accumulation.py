"""Gradient accumulation steps like one batch: SFT divides a step by all its target tokens (TRL's
``num_items_in_batch``), and an epoch's shorter last step is a whole step for every offline method.

The loader's look ahead is checked on its own; then whole runs: micro-batches of 2 or 1 accumulated to a
step of 4 rows end with the weights of batches of 4, on answers of 1 to 5 words (a token mean per
micro-batch weighs a token of a short micro-batch more, and moves the weights by ~1e-2 here).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from ddp_helpers import COMMON, write_variable_length_data

from helpers import compose_train
from lightning_vlm.data.lookahead import KEEP_BEHIND, LookaheadBatch
from lightning_vlm.data.resumable import ResumableDataLoader
from lightning_vlm.methods.step_tokens import StepTokens
from lightning_vlm.methods.step_window import WholeSteps, micro_batches_in_window
from lightning_vlm.training import train


def _loader(lookahead: bool, n: int = 10) -> ResumableDataLoader:
    return ResumableDataLoader(list(range(n)), batch_size=2, seed=3, lookahead=lookahead, collate_fn=list)


def test_a_look_ahead_shows_the_next_batches_without_moving_the_loader():
    plain = list(_loader(False))
    loader = _loader(True)
    batches = iter(loader)
    first, second = next(batches), next(batches)  # Lightning holds one batch ahead of the step
    assert isinstance(first, LookaheadBatch) and (first.rows, second.rows) == (plain[0], plain[1])
    assert first.after(3) == [(1, plain[1]), (2, plain[2]), (3, plain[3])]
    assert loader.state_dict()["batches"] == 2  # pulled early, not handed out: the position is the same
    rest = list(batches)
    assert [b.rows for b in rest] == plain[2:]  # each batch once, in order
    assert rest[-2].after(5) == [(4, plain[4])]  # fewer at the end of the pass
    assert loader.state_dict()["samples"] == 10
    # the next pass starts afresh, and a checkpoint restored mid-epoch continues where the plain one does
    resumed = _loader(True)
    resumed.load_state_dict({"epoch": 0, "batches": 2, "samples": 4})
    assert [b.rows for b in resumed] == plain[2:]


def test_a_look_too_far_back_is_an_error_not_another_batch():
    batches = iter(_loader(True, n=2 * (KEEP_BEHIND + 4)))
    first = next(batches)
    for _ in range(KEEP_BEHIND + 2):
        next(batches)
    with pytest.raises(RuntimeError, match="looked back more than"):
        first.after(1)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """The variable-length SFT rows, and files of the first 6 SFT and preference rows (read in order)."""
    path = write_variable_length_data(tmp_path_factory.mktemp("step_tokens")) / "sft.jsonl"
    for name, n in (("sft", 6), ("preference", 6), ("preference", 5)):
        lines = path.with_name(f"{name}.jsonl").read_text().splitlines(keepends=True)
        path.with_name(f"{name}{n}.jsonl").write_text("".join(lines[:n]))
    return path


def _weights(overrides: list[str], tmp_path) -> dict[str, torch.Tensor]:
    """The weights after training with ``overrides`` (a method among them)."""
    path = tmp_path / "weights.pt"
    # No clipping: a clipped step keeps only the gradient's direction, and a wrong divisor changes its size
    train(compose_train([*COMMON, "trainer.gradient_clip_val=null", *overrides, "+callbacks.save._target_=ddp_helpers.SaveWeights",
                         f"+callbacks.save.path={path}"], tmp_path))  # fmt: skip
    return torch.load(path, weights_only=True)


def _assert_same_weights(whole: dict, parts: dict, start: dict) -> None:
    moved = max((whole[k] - start[k]).abs().max().item() for k in whole)
    assert moved > 1e-2, f"the weights hardly moved ({moved:.2e}); the comparison would be vacuous"
    for key, value in whole.items():
        torch.testing.assert_close(parts[key], value, atol=1e-5, rtol=0, msg=key)


@pytest.fixture(scope="module")
def start_weights(tiny_path):
    from lightning_vlm.models.vlm import VLM

    return {k: v.detach().clone() for k, v in VLM(tiny_path(), freeze_vision_tower=False).named_parameters()}


@pytest.mark.parametrize("micro", [2, 1])
def test_accumulated_micro_batches_update_like_one_batch(micro, sft_data, start_weights, tmp_path):
    data = ["method=sft", f"data.train={sft_data}", "trainer.max_steps=2"]
    whole = _weights([*data, "data.batch_size=4"], tmp_path / "whole")
    parts = _weights([*data, f"data.batch_size={micro}", f"trainer.accumulate_grad_batches={4 // micro}"],
                     tmp_path / "parts")  # fmt: skip
    _assert_same_weights(whole, parts, start_weights)


@pytest.mark.parametrize(
    "cut",
    [
        [],  # 6 rows: the epoch's last window holds one micro-batch of 2 (Lightning still divides by 2)
        ["trainer.limit_train_batches=3"],  # 32 rows cut at 3 batches: the 4th is no part of the window
    ],
)
def test_the_epoch_s_short_last_window_is_the_token_mean_of_its_rows(cut, sft_data, start_weights, tmp_path):
    in_order = ["method=sft", "data.shuffle=false", "trainer.max_steps=2"]
    six = sft_data.with_name("sft6.jsonl")
    whole = _weights([*in_order, f"data.train={six}", "data.batch_size=4"], tmp_path / "whole")
    source = sft_data if cut else six
    parts = _weights([*in_order, f"data.train={source}", *cut, "data.batch_size=2",
                      "trainer.accumulate_grad_batches=2"], tmp_path / "parts")  # fmt: skip
    _assert_same_weights(whole, parts, start_weights)


def test_the_first_rows_are_read_in_order(sft_data):
    # The short-window cases rely on the 6-row file holding the 32-row file's first rows.
    rows = [json.loads(line) for line in sft_data.with_name("sft6.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["images"] == ["0.png"]


def _module(k: int, batches: int = 10, engine_accumulates: bool = False) -> SimpleNamespace:
    strategy = SimpleNamespace(handles_gradient_accumulation=engine_accumulates)
    trainer = SimpleNamespace(accumulate_grad_batches=k, num_training_batches=batches, strategy=strategy)
    return SimpleNamespace(trainer=trainer, current_epoch=0, device=torch.device("cpu"))


def _labels(rows: list[int]) -> dict:
    """A fake encoding: row r has r target tokens (of 6 positions)."""
    return {"labels": torch.tensor([[0] * r + [-100] * (6 - r) for r in rows])}


def test_the_divisor_counts_the_window_s_micro_batches_and_stops_at_the_epoch_s_end():
    tokens = StepTokens(_labels)
    batches = iter(ResumableDataLoader([1, 2, 3, 4, 5], batch_size=2, shuffle=False, lookahead=True,
                                       collate_fn=list))  # fmt: skip
    first, second, third = list(batches)
    module = _module(k=2, batches=3)
    inputs, divisor = tokens.take(module, first, 0)
    assert inputs["labels"].shape[0] == 2 and divisor == 1 + 2 + 3 + 4
    assert tokens.take(module, second, 1)[1] == 10  # encoded at the window's first micro-batch
    assert tokens.take(module, third, 2)[1] == 5  # the epoch's last window: one micro-batch


def test_a_loader_that_cannot_look_ahead_keeps_the_mean_of_the_micro_batches_means(caplog):
    tokens = StepTokens(_labels)
    with caplog.at_level("WARNING"):
        # SFT multiplies its loss by k and Lightning divides it by k: k × the own tokens is a mean per micro-batch
        assert tokens.take(_module(k=2), [1, 2], 0)[1] == 2 * 3
        assert tokens.take(_module(k=2), [3], 1)[1] == 2 * 3
    assert caplog.text.count("cannot look ahead") == 1
    assert tokens.take(_module(k=1), [1, 2], 0)[1] == 3


@pytest.mark.parametrize(
    ("method", "rows", "steps"),
    [
        (["method=dpo"], 6, 2),  # 6 pairs: steps of 4 and 2
        # 5 rows, 10 unpaired: steps of 4, 4 and 2. Without KTO's KL term, estimated from the batch's
        # mismatched pairs (batch-dependent).
        (["method=kto", "method.loss_type=apo_zero_unpaired"], 5, 3),
    ],
    ids=["dpo", "kto"],
)
def test_an_epoch_s_short_last_step_is_a_whole_step_for_the_preference_methods(
    method, rows, steps, sft_data, start_weights, tmp_path
):
    # Accumulated in micro-batches of 2, the last step has one micro-batch, which Lightning divides by
    # accumulate_grad_batches=2 (a half step); TRL divides by the micro-batches the step has.
    data = [f"data.train={sft_data.with_name(f'preference{rows}.jsonl')}", "data.shuffle=false",
            f"trainer.max_steps={steps}"]  # fmt: skip
    whole = _weights([*method, *data, "data.batch_size=4"], tmp_path / "whole")
    parts = _weights([*method, *data, "data.batch_size=2", "trainer.accumulate_grad_batches=2"],
                     tmp_path / "parts")  # fmt: skip
    _assert_same_weights(whole, parts, start_weights)


def test_an_epoch_s_last_window_holds_the_batches_left_and_steps_whole():
    # 7 batches, 3 a step: windows [0, 1, 2], [3, 4, 5], [6]
    assert [micro_batches_in_window(_module(3, 7), i) for i in range(7)] == [3, 3, 3, 3, 3, 3, 1]
    steps = WholeSteps()
    assert [steps.scale(_module(3, 7), i) for i in range(7)] == [1.0] * 6 + [3.0]
    # a resume inside the second window (at batch 4): batches 4 and 5 make its step, 3 is gone
    resumed = WholeSteps()
    assert [resumed.scale(_module(3, 7), i) for i in (4, 5, 6)] == [1.5, 1.5, 3.0]
    # DeepSpeed's engine steps every 3 micro-batches across epochs: Lightning's windows are not its steps
    assert WholeSteps().scale(_module(3, 7, engine_accumulates=True), 6) == 1.0
    assert WholeSteps().scale(_module(1, 7), 6) == 1.0


@pytest.mark.parametrize(
    ("engine", "batches", "warned"), [(True, 7, True), (True, 6, False), (False, 7, False)]
)
def test_deepspeed_steps_across_epochs_are_warned_of(engine, batches, warned, caplog):
    from lightning_vlm.methods.common import warn_steps_across_epochs

    with caplog.at_level("WARNING"):
        warn_steps_across_epochs(_module(3, batches, engine_accumulates=engine).trainer)
    assert ("cross epoch ends" in caplog.text) == warned
