"""The arithmetic behind benchmarks/dynamic_sampling.py's figures: where a validation curve crosses the
gain, and which learning rate each method is compared at. Hand-computed cases."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "dynamic_sampling.py"
_SPEC = importlib.util.spec_from_file_location("dynamic_sampling_benchmark", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _curve(*points: tuple[int, float, float]) -> list[dict]:
    return [{"step": s, "completions": c, "val_reward": v} for s, c, v in points]


def test_first_gain_interpolates_between_the_validations_around_the_crossing():
    # start 0.4, target 0.6: first reached between (20, 640, 0.5) and (40, 1280, 0.7), halfway
    curve = _curve((0, 0, 0.4), (20, 640, 0.5), (40, 1280, 0.7), (60, 1920, 0.65))
    hit = bench.first_gain(curve, 0.2)
    assert hit["step"] == pytest.approx(30.0)
    assert hit["completions"] == pytest.approx(960.0)
    assert hit["validation_after"]["step"] == 40


def test_first_gain_is_none_when_the_curve_never_reaches_it():
    assert bench.first_gain(_curve((0, 0, 0.4), (20, 640, 0.59), (40, 1280, 0.3)), 0.2) is None


def _summary(grpo: float | None, dynamic: float | None) -> dict:
    completions = {"grpo": grpo, "dynamic_sampling": dynamic}
    steps = {k: None if v is None else v / 32 for k, v in completions.items()}
    return {"median_completions_to_gain": completions, "median_steps_to_gain": steps}


def test_best_lr_takes_each_method_at_its_own_cheapest_rate():
    by_lr = {
        "0.0005": _summary(3000.0, 3300.0),
        "0.001": _summary(4000.0, 2900.0),
        "0.002": _summary(None, None),  # neither reached the gain: not a candidate
    }
    best = bench.best_lr(by_lr)
    assert best["grpo"] == {"lr": 0.0005, "completions": 3000.0, "steps": 3000.0 / 32}
    assert best["dynamic_sampling"]["lr"] == 0.001
    assert best["ratio_dynamic_over_grpo"] == pytest.approx(2900.0 / 3000.0)


def test_summarize_counts_a_run_that_never_reached_the_gain_as_the_most_expensive():
    def runs(*completions):
        return [
            {"reached": None if c is None else {"completions": c, "step": c / 32},
             "curve": [{"val_reward": 0.5}]}
            for c in completions
        ]  # fmt: skip

    summary = bench.summarize({"grpo": runs(3000.0, None, 2000.0), "dynamic_sampling": runs(None, None, 1.0)})
    assert summary["median_completions_to_gain"] == {"grpo": 3000.0, "dynamic_sampling": None}
    assert summary["ratio_dynamic_over_grpo"] is None
