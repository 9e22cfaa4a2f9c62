"""Completions generated until GRPO gains +0.2 on the colour task, with and without dynamic sampling.

Usage: ``python benchmarks/dynamic_sampling.py [--steps 200] [--out benchmarks/results/dynamic_sampling.json]``.
Both runs are ``train.py`` from the tiny Qwen2.5-VL's SFT warm start with ``num_generations=4`` (with 8
samples almost no group of the warm start ties: 0.38^8 + 0.62^8 = 2 %; with 4, 17 %) and 8 groups
trained per step: ``method=grpo`` (8 prompts per step) and ``method=dapo``'s dynamic sampling (a pool of
24 prompts in up to 3 rounds of 8), with the clipping and loss of GRPO in both, so only the sampling
differs. Validation (the sampled accuracy reward of 4 completions for each of 64 held-out prompts) runs
every ``--every`` steps; the figure is ``train/completions_generated`` (all completions sampled, the
filtered ones included) at the first validation at least 0.2 above the starting value.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["method.num_generations=4", "logger=csv", "callbacks=none", "validate_before_fit=true",
          "trainer.enable_progress_bar=false", "optimized_metric=null", "data.synthetic.num_val=64"]  # fmt: skip
RUNS = {
    "grpo": ["method=grpo", "data.batch_size=8"],
    "dynamic_sampling": [
        "method=grpo",
        "data.batch_size=24",
        "method.dynamic_sampling={enabled:true,max_num_gen_batches:3}",
    ],  # fmt: skip
}


def run(name: str, steps: int, every: int, folder: Path) -> list[dict]:
    """One ``train.py`` run; (step, completions generated, val reward) at every validation."""
    args = [*RUNS[name], *COMMON, f"trainer.max_steps={steps}", f"trainer.val_check_interval={every}",
            f"hydra.run.dir={folder}"]  # fmt: skip
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
    start = points[0]["val_reward"]
    return next((p for p in points[1:] if p["val_reward"] >= start + gain), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--gain", type=float, default=0.2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dynamic_sampling.json"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            points = run(name, args.steps, args.every, Path(tmp) / name)
            hit = first_gain(points, args.gain)
            results[name] = {"curve": points, "reached": hit}
            print(name, f"reached +{args.gain:.1f} at", hit, flush=True)
    a, b = results["grpo"]["reached"], results["dynamic_sampling"]["reached"]
    summary = {
        "completions_to_gain": {k: (v["reached"] or {}).get("completions") for k, v in results.items()},
        "ratio_dynamic_over_grpo": (b["completions"] / a["completions"]) if a and b else None,
    }
    out = {"gain": args.gain, "steps": args.steps, "every": args.every, "machine": platform.platform(),
           "summary": summary, "runs": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
