"""Completions generated until GRPO gains +0.2 on the colour task, with and without dynamic sampling.

Usage: ``python benchmarks/dynamic_sampling.py [--steps 200] [--seeds 0 1 2] [--num-generations 4]
[--groups 8] [--lrs LR ...] [--out benchmarks/results/dynamic_sampling.json]`` (``--num-generations 2`` wrote
``dynamic_sampling_g2.json``; ``--steps 240 --lrs 2.5e-4 5e-4 7e-4 8.5e-4 1e-3 1.2e-3 1.5e-3 2e-3`` gives
``dynamic_sampling_lr.json``, which also compares each method at its own best learning rate; that file
was run as three invocations over parts of the grid and merged, see below). ``--merge A.json B.json
--out C.json`` pools sweeps instead of running: ``dynamic_sampling_heldout.json`` is 8 more seeds
(``--seeds 3 4 5 6 7 8 9 10``) at the rates around each method's best (7e-4 to 1.2e-3), so the rates
chosen on seeds 0-2 are checked on seeds they were not chosen on (a best of few noisy medians flatters
whichever method had lucky seeds); ``dynamic_sampling_pooled.json`` merges it with the grid (11 seeds
at those rates, 3 elsewhere). ``--groups 4`` (the library's default batch: ``method=grpo`` trains 4 groups
a step, ``method=dapo`` a pool of 3 x 4) with ``--steps 300`` wrote ``dynamic_sampling_g4_lr.json``
(``--lrs 2.5e-4 5e-4 7e-4 1e-3 1.5e-3``, seeds 0-2) and ``dynamic_sampling_g4_heldout.json`` (``--lrs 5e-4
7e-4 --seeds 3 4 5 6 7 8 9 10``), pooled into ``dynamic_sampling_g4_pooled.json``.
Both runs are ``train.py`` from the tiny Qwen2.5-VL's SFT warm start with ``num_generations=4`` (with 8
samples almost no group of the warm start ties: 0.38^8 + 0.62^8 = 2 %; with 4, 17 %; with 2, half) and 8
groups trained per step unless ``--groups`` says otherwise: ``method=grpo`` (8 prompts per step) and
``method=dapo``'s dynamic sampling (a pool of 24 prompts in up to 3 rounds of 8), with the clipping and loss
of GRPO in both, so only the sampling differs. Validation (the sampled accuracy reward of 4 completions for
each of 64 held-out prompts) runs every ``--every`` steps; the figure is ``train/completions_generated`` (all
completions sampled, the filtered ones included) when the validation curve first reaches 0.2 above the
starting value, read by linear interpolation between the two validations around that point. Each run is
repeated with several training seeds (data order and sampling; the warm start is shared) and the medians are
compared: one run of each is too noisy to decide (validation moves by +-0.05 between neighbouring points). The
counts are deterministic on one machine (same seeds, same threads), so separate invocations over parts of a
learning-rate grid give the numbers one invocation would (checked: the 5e-4 runs of the sweep repeat
``dynamic_sampling.json`` completion for completion). The medians of steps and of completions are taken
separately, so they may come from different seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("benchmarks") / "results" / "dynamic_sampling.json"  # under ROOT
COMMON = ["logger=csv", "callbacks=none", "validate_before_fit=true",
          "trainer.enable_progress_bar=false", "optimized_metric=null", "data.synthetic.num_val=64"]  # fmt: skip
RUNS = ("grpo", "dynamic_sampling")
ROUNDS = 3  # dynamic sampling's pool: up to 3 rounds of one step's groups
DEFAULT_GROUPS = 8  # groups trained per step (sweeps written before --groups existed used 8)


def overrides(name: str, groups: int) -> list[str]:
    """``train.py`` overrides of one method training on ``groups`` groups per step."""
    if name == "grpo":
        return ["method=grpo", f"data.batch_size={groups}"]
    return ["method=grpo", f"data.batch_size={ROUNDS * groups}",
            f"method.dynamic_sampling={{enabled:true,max_num_gen_batches:{ROUNDS}}}"]  # fmt: skip


def run(
    name: str,
    steps: int,
    every: int,
    seed: int,
    generations: int,
    folder: Path,
    lr: float | None = None,
    groups: int = DEFAULT_GROUPS,
) -> list[dict]:
    """One ``train.py`` run; (step, completions generated, val reward) at every validation."""
    args = [*overrides(name, groups), *COMMON, f"method.num_generations={generations}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={every}", f"seed={seed}",
            f"hydra.run.dir={folder}"]  # fmt: skip
    if lr is not None:
        args.append(f"method.optimizer.lr={lr}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    (metrics,) = folder.glob("csv/version_0/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    generated = {int(r["step"]): float(r["train/completions_generated"]) for r in rows
                 if r.get("train/completions_generated")}  # fmt: skip
    points = []
    for r in rows:
        if r.get("val/rewards/accuracy_reward"):
            step = int(r["step"])
            # validation at step s follows optimizer step s (logged as s), or runs before training (0)
            count = max((c for s, c in generated.items() if s <= step), default=0.0)
            points.append(
                {"step": step, "completions": count, "val_reward": float(r["val/rewards/accuracy_reward"])}
            )
    return points


def first_gain(points: list[dict], gain: float) -> dict | None:
    """Step and completions where the curve first reaches ``start + gain``, interpolated linearly between
    the validation below and the one at or above; None when it never does."""
    target = points[0]["val_reward"] + gain
    for below, above in zip(points, points[1:], strict=False):
        if above["val_reward"] >= target:
            t = (target - below["val_reward"]) / (above["val_reward"] - below["val_reward"])
            at = {k: below[k] + t * (above[k] - below[k]) for k in ("step", "completions")}
            return {**at, "validation_after": above}
    return None


def summarize(results: dict[str, list[dict]]) -> dict:
    """Medians over seeds; a run that never reaches the gain counts as the most expensive one."""

    def median(name: str, key: str) -> float | None:
        values = [r["reached"][key] if r["reached"] else float("inf") for r in results[name]]
        value = statistics.median(values)
        return None if value == float("inf") else value

    completions = {name: median(name, "completions") for name in RUNS}
    a, b = completions["grpo"], completions["dynamic_sampling"]
    return {
        "median_completions_to_gain": completions,
        "median_steps_to_gain": {name: median(name, "step") for name in RUNS},
        "ratio_dynamic_over_grpo": (b / a) if a and b else None,
        "final_val_reward": {name: statistics.median(r["curve"][-1]["val_reward"] for r in results[name])
                             for name in RUNS},
    }  # fmt: skip


def best_lr(by_lr: dict[str, dict]) -> dict:
    """Each method at its own best learning rate (fewest median completions to the gain): the fair
    comparison when one method tolerates larger steps than the other."""
    best: dict[str, dict] = {}
    for name in RUNS:
        reached = {lr: s["median_completions_to_gain"][name] for lr, s in by_lr.items()
                   if s["median_completions_to_gain"][name] is not None}  # fmt: skip
        if reached:
            lr = min(reached, key=reached.__getitem__)
            best[name] = {"lr": float(lr), "completions": reached[lr],
                          "steps": by_lr[lr]["median_steps_to_gain"][name]}  # fmt: skip
    a, b = best.get("grpo"), best.get("dynamic_sampling")
    return {**best, "ratio_dynamic_over_grpo": b["completions"] / a["completions"] if a and b else None}


SETTINGS = ("gain", "steps", "every", "num_generations", "groups")  # must agree for runs to be pooled


def setting(sweep: dict, key: str) -> object:
    """One of a sweep's ``SETTINGS`` (files written before ``--groups`` existed used the default)."""
    return sweep.get(key, DEFAULT_GROUPS) if key == "groups" else sweep[key]


def merge(files: dict[str, dict]) -> dict:
    """Pool the runs of several learning-rate sweeps (parts of a grid, or more seeds of the same rates)
    per rate and method, and recompute the medians and the best rates from all of them. Sweeps measured
    under other settings, or a seed measured twice, cannot be pooled: a ValueError names the file."""
    first_name, first = next(iter(files.items()))
    by_lr: dict[str, dict] = {}
    for name, sweep in files.items():
        if "by_lr" not in sweep:
            raise ValueError(f"{name}: not a learning-rate sweep (no by_lr; run with --lrs)")
        for key in SETTINGS:
            if setting(sweep, key) != setting(first, key):
                raise ValueError(
                    f"{name}: {key}={setting(sweep, key)}, but {first_name} has {setting(first, key)}"
                )
        for lr, part in sweep["by_lr"].items():
            pooled = by_lr.setdefault(str(float(lr)), {name_: [] for name_ in RUNS})
            for method in RUNS:
                seen = {r["seed"] for r in pooled[method]}
                again = seen & {r["seed"] for r in part["runs"][method]}
                if again:
                    raise ValueError(f"{name}: {method} at lr {lr} repeats seed(s) {sorted(again)}")
                pooled[method].extend(part["runs"][method])
    out_by_lr = {
        lr: {"seeds": sorted(r["seed"] for r in runs["grpo"]), "summary": summarize(runs), "runs": runs}
        for lr, runs in sorted(by_lr.items(), key=lambda kv: float(kv[0]))
    }
    return {
        **{key: setting(first, key) for key in SETTINGS},
        "seeds": sorted({seed for v in out_by_lr.values() for seed in v["seeds"]}),
        "machine": first["machine"],
        "merged_from": list(files),
        "best_lr": best_lr({lr: v["summary"] for lr, v in out_by_lr.items()}),
        "by_lr": out_by_lr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--gain", type=float, default=0.2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--groups", type=int, default=DEFAULT_GROUPS, help="groups trained per step")
    # learning rates to sweep (both methods at each); none = the config's (scale.lr.online)
    parser.add_argument("--lrs", type=float, nargs="+", default=None)
    parser.add_argument("--out", default=None, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="pool these sweeps' runs into --out")
    args = parser.parse_args()
    if args.merge:
        if args.out is None:  # the default would overwrite a measured file with a merge
            parser.error("--merge needs --out")
        merged = merge({Path(f).name: json.loads(Path(f).read_text()) for f in args.merge})
        Path(args.out).write_text(json.dumps(merged, indent=2) + "\n")
        print("best lr:", json.dumps(merged["best_lr"], indent=2))
        return
    by_lr: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lr in args.lrs or [None]:
            results: dict[str, list[dict]] = {name: [] for name in RUNS}
            for seed in args.seeds:
                for name in RUNS:
                    folder = Path(tmp) / f"{name}-{seed}-{lr}"
                    points = run(
                        name, args.steps, args.every, seed, args.num_generations, folder, lr, args.groups
                    )
                    hit = first_gain(points, args.gain)
                    results[name].append({"seed": seed, "curve": points, "reached": hit})
                    print(name, f"lr {lr} seed {seed} reached +{args.gain:.1f} at", hit, flush=True)
            by_lr[str(lr)] = {"summary": summarize(results), "runs": results}
            print(f"lr {lr}:", json.dumps(by_lr[str(lr)]["summary"], indent=2), flush=True)
    out = {"gain": args.gain, "steps": args.steps, "every": args.every, "seeds": args.seeds,
           "num_generations": args.num_generations, "groups": args.groups,
           "machine": platform.platform()}  # fmt: skip
    if args.lrs is None:  # one setting: its summary and runs at the top, as before
        out.update(by_lr["None"])
    else:
        out["best_lr"] = best_lr({lr: v["summary"] for lr, v in by_lr.items()})
        out["by_lr"] = by_lr
        print("best lr:", json.dumps(out["best_lr"], indent=2))
    Path(args.out or ROOT / DEFAULT_OUT).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
