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


def _runs(completions: list, seeds: list[int] | None = None) -> list[dict]:
    """One run per seed with its completions to the gain (None: never reached), 32 completions a step."""
    seeds = list(range(len(completions))) if seeds is None else seeds
    return [
        {"seed": seed, "curve": [{"val_reward": 0.5}],
         "reached": None if c is None else {"completions": c, "step": c / 32}}
        for seed, c in zip(seeds, completions, strict=True)
    ]  # fmt: skip


def test_summarize_counts_a_run_that_never_reached_the_gain_as_the_most_expensive():
    summary = bench.summarize(
        {"grpo": _runs([3000.0, None, 2000.0]), "dynamic_sampling": _runs([None, None, 1.0])}
    )
    assert summary["median_completions_to_gain"] == {"grpo": 3000.0, "dynamic_sampling": None}
    assert summary["ratio_dynamic_over_grpo"] is None


def _sweep(seeds: list[int], by_lr: dict[str, tuple[list, list]], steps: int = 240) -> dict:
    """A sweep file with each seed's completions to the gain (None: never reached) per rate and method."""
    settings = {"gain": 0.2, "steps": steps, "every": 20, "num_generations": 4, "machine": "m"}
    rates = {
        lr: {"runs": {"grpo": _runs(g, seeds), "dynamic_sampling": _runs(d, seeds)}}
        for lr, (g, d) in by_lr.items()
    }
    return {**settings, "seeds": seeds, "by_lr": rates}


def test_merge_pools_the_seeds_of_each_rate_and_recomputes_medians_and_best_rates():
    grid = _sweep(
        [0, 1, 2],
        {
            "0.0005": ([3000, 3100, 2900], [3300, 3400, 3200]),
            "0.001": ([None, 5000, 4000], [2900, 3000, 3100]),
        },
    )
    more = _sweep([3, 4], {"0.001": ([1000, 1100], [4000, 4100])})
    merged = bench.merge({"grid.json": grid, "more.json": more})
    assert merged["merged_from"] == ["grid.json", "more.json"]
    assert merged["seeds"] == [0, 1, 2, 3, 4]
    assert merged["by_lr"]["0.0005"]["seeds"] == [0, 1, 2]
    at_1e3 = merged["by_lr"]["0.001"]
    assert at_1e3["seeds"] == [0, 1, 2, 3, 4]
    # grpo: 1000 1100 4000 5000 inf -> 4000; dynamic sampling: 2900 3000 3100 4000 4100 -> 3100
    assert at_1e3["summary"]["median_completions_to_gain"] == {"grpo": 4000, "dynamic_sampling": 3100}
    # best rates over the pooled medians: grpo 3000 at 5e-4, dynamic sampling 3100 at 1e-3
    assert merged["best_lr"]["grpo"]["lr"] == 0.0005
    assert merged["best_lr"]["dynamic_sampling"] == {"lr": 0.001, "completions": 3100, "steps": 3100 / 32}
    assert merged["best_lr"]["ratio_dynamic_over_grpo"] == pytest.approx(3100 / 3000)


def test_merge_refuses_sweeps_it_cannot_pool_and_names_the_file():
    grid = _sweep([0, 1], {"0.001": ([1, 2], [3, 4])})
    with pytest.raises(ValueError, match=r"longer.json: steps=300, but grid.json has 240"):
        bench.merge({"grid.json": grid, "longer.json": _sweep([2], {"0.001": ([1], [2])}, steps=300)})
    with pytest.raises(ValueError, match=r"again.json: grpo at lr 0.001 repeats seed\(s\) \[1\]"):
        bench.merge({"grid.json": grid, "again.json": _sweep([1], {"0.001": ([1], [2])})})
    with pytest.raises(ValueError, match=r"one.json: not a learning-rate sweep"):
        bench.merge({"grid.json": grid, "one.json": {"gain": 0.2, "runs": {}}})


def test_merge_pools_only_sweeps_of_the_same_groups_per_step_and_reads_older_files_as_8():
    old = _sweep([0], {"0.001": ([1], [2])})  # written before --groups: 8 groups per step
    eight = {**_sweep([1], {"0.001": ([3], [4])}), "groups": 8}
    assert bench.merge({"old.json": old, "eight.json": eight})["groups"] == 8
    four = {**_sweep([1], {"0.001": ([3], [4])}), "groups": 4}
    with pytest.raises(ValueError, match=r"four.json: groups=4, but old.json has 8"):
        bench.merge({"old.json": old, "four.json": four})


@pytest.mark.parametrize("groups", [4, 8])
def test_both_methods_train_on_the_same_groups_per_step(groups):
    from lightning_vlm.methods.dynamic_sampling import DynamicSampling

    (grpo_batch,) = [o for o in bench.overrides("grpo", groups) if o.startswith("data.batch_size=")]
    assert grpo_batch == f"data.batch_size={groups}"
    dynamic = bench.overrides("dynamic_sampling", groups)
    (pool,) = [int(o.split("=")[1]) for o in dynamic if o.startswith("data.batch_size=")]
    settings = DynamicSampling(enabled=True, max_num_gen_batches=bench.ROUNDS)
    assert "method.dynamic_sampling={enabled:true,max_num_gen_batches:3}" in dynamic
    assert settings.round_size(pool) == groups  # the groups each dynamic-sampling step trains on
