"""The sweep summary's choice of a best job (lightning_vlm/sweeps.py), on hand-made job records."""

from __future__ import annotations

import json

from lightning_vlm.sweeps import best_per_metric, render_markdown


def _job(num, metric, value, mode="max"):
    return {"job": num, "overrides": [f"x={num}"], "metric": metric, "mode": mode, "value": value,
            "status": "completed" if value is not None else "failed", "error": None, "dir": "."}  # fmt: skip


def test_a_sweep_across_metrics_names_a_best_per_metric_not_one_over_all():
    # SFT's answer accuracy 0.4 and GRPO's mean reward 0.9 are not comparable: the old summary named
    # the GRPO job best of the sweep.
    jobs = [_job(0, "val/answer_accuracy", 0.4), _job(1, "val/reward", 0.9), _job(2, "val/answer_accuracy", 0.6),
            _job(3, "val/loss", 0.3, "min"), _job(4, "val/loss", 0.2, "min"), _job(5, "val/reward", None)]  # fmt: skip
    bests = best_per_metric(jobs)
    assert {m: b["job"] for m, b in bests.items()} == {
        "val/answer_accuracy": 2,
        "val/reward": 1,
        "val/loss": 4,
    }
    summary = {"metric": None, "mode": None, "best": None, "best_per_metric": bests, "jobs": jobs}
    table = render_markdown(summary).splitlines()
    assert table[0] == "# Sweep: several metrics, one best each"
    # best first within each metric, a failed job last in its metric
    assert [line.split("|")[1].strip() for line in table[4:]] == ["2", "0", "4", "3", "1", "5"]
    assert best_per_metric([_job(0, "val/reward", None)]) == {"val/reward": None}


def _summary_of_two_losses(cfg, folder, losses=(2.0, 0.5)) -> dict:
    """summary.json of a sweep (``cfg``: its composed config) whose jobs returned ``losses`` (2.0 and 0.5)."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from lightning_vlm.sweeps import SweepSummary

    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    summary = SweepSummary()
    summary.on_multirun_start(cfg)
    for num, loss in enumerate(losses):
        cfg.hydra.job.num, cfg.hydra.runtime.output_dir = num, str(folder / str(num))
        summary.on_job_end(
            cfg, JobReturn(overrides=[f"t={num}"], status=JobStatus.COMPLETED, _return_value=loss)
        )
    return json.loads((folder / "summary.json").read_text(), parse_constant=_not_json)


def _not_json(constant: str):
    raise ValueError(f"summary.json holds {constant}, which strict JSON readers (jq, JavaScript) refuse")


def test_the_sweepers_direction_ranks_the_trials(tmp_path):
    # The summary took monitor_mode (max) while Optuna minimised val/loss: it named the worst trial best.
    from helpers import compose_train

    for direction, best in (("minimize", 0.5), ("maximize", 2.0)):
        folder = tmp_path / direction
        cfg = compose_train(["hparams_search=sft_optuna", "optimized_metric=val/loss",
                             f"hydra.sweeper.direction={direction}", f"hydra.sweep.dir={folder}"])  # fmt: skip
        written = _summary_of_two_losses(cfg, folder)
        assert written["mode"] == direction[:3] and written["best"]["value"] == best


def test_the_basic_sweeper_ranks_by_optimized_mode(tmp_path):
    # The basic sweeper has no direction: the summary took monitor_mode (max), naming the highest loss best;
    # monitor_mode=min would also flip the best checkpoint's direction.
    from helpers import compose_train

    overrides = [
        "optimized_metric=val/loss",
        "optimized_mode=min",
        "hydra.mode=MULTIRUN",
        f"hydra.sweep.dir={tmp_path}",
    ]
    cfg = compose_train(overrides)
    assert cfg.monitor_mode == "max"  # the checkpoints still keep the best answer accuracy
    written = _summary_of_two_losses(cfg, tmp_path)
    assert written["mode"] == "min" and written["best"]["value"] == 0.5


def test_a_diverged_job_is_reported_last_and_the_summary_stays_json(tmp_path):
    # A NaN val/loss sorted anywhere in summary.md (-(nan) compares false) and went into summary.json as a
    # bare NaN, which jq refuses.
    from helpers import compose_train

    overrides = [
        "optimized_metric=val/loss",
        "optimized_mode=min",
        "hydra.mode=MULTIRUN",
        f"hydra.sweep.dir={tmp_path}",
    ]
    written = _summary_of_two_losses(
        compose_train(overrides), tmp_path, (2.0, float("nan"), 0.5, float("inf"))
    )
    assert written["best"]["value"] == 0.5
    assert [(j["value"], j["value_reported"]) for j in written["jobs"]] == [(2.0, None), (None, "nan"), (0.5, None),
                                                                            (None, "inf")]  # fmt: skip
    rows = (tmp_path / "summary.md").read_text().splitlines()[4:]
    assert [(r.split("|")[1].strip(), r.split("|")[3].strip()) for r in rows] == [
        ("2", "0.5000"),
        ("0", "2.0000"),
        ("1", "nan"),
        ("3", "inf"),
    ]
