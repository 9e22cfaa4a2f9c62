"""Training throughput on 1 vs 2 CPU processes (Lightning DDP, gloo) for SFT, DPO and GRPO.

Usage: ``python benchmarks/ddp_throughput.py [--steps 40] [--out benchmarks/results/ddp_throughput.json]``.
Each run is ``train.py`` as a user starts it (``trainer=ddp trainer.accelerator=cpu trainer.devices=2``
for two processes, the default trainer for one), on the tiny Qwen2.5-VL and the synthetic task, with
the per-process batch of the method's default config: two processes train on twice the rows per step.
One process uses both cores (2 torch threads), each of two processes one. Lightning's
``ThroughputMonitor`` measures samples (rows: conversations, pairs, prompts) per second over a
rolling window; the figure is the median of its values after the first window (warm-up excluded).
The runs alternate 1, 2, 1, 2 ... per method so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 10
KEY = "train/device/samples_per_sec"
TWO = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]


def run(method: str, processes: int, steps: int, folder: Path) -> list[float]:
    """One ``train.py`` run; the global samples/s values ThroughputMonitor logged after warm-up."""
    args = [
        f"method={method}", "logger=csv", "callbacks=none", f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "optimized_metric=null", f"hydra.run.dir={folder}",
        "+callbacks.throughput._target_=lightning.pytorch.callbacks.ThroughputMonitor",
        "+callbacks.throughput.batch_size_fn._target_=hydra.utils.get_method",
        "+callbacks.throughput.batch_size_fn.path=builtins.len", f"+callbacks.throughput.window_size={WINDOW}",
        *(TWO if processes == 2 else []),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("OMP_NUM_THREADS", None)  # Lightning gives each of 2 processes 1 thread; 1 process keeps 2
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{method} on {processes} process(es) failed:\n{proc.stderr[-3000:]}")
    rows = list(csv.DictReader(next(folder.rglob("metrics.csv")).open()))
    # Rank 0's rate times the processes (every rank trains on as many rows per step).
    values = [processes * float(r[KEY]) for r in rows if r.get(KEY)]
    return values[WINDOW:] or values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["sft", "dpo", "grpo"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ddp_throughput.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            samples: dict[int, list[float]] = {1: [], 2: []}
            for repeat in range(args.repeats):
                for processes in (1, 2):
                    folder = Path(tmp) / f"{method}-{processes}-{repeat}"
                    samples[processes] += run(method, processes, args.steps, folder)
            one, two = statistics.median(samples[1]), statistics.median(samples[2])
            results.append({
                "method": method, "samples_per_s_1_process": round(one, 2), "samples_per_s_2_processes": round(two, 2),
                "ratio_2_over_1": round(two / one, 3), "measurements_1": len(samples[1]), "measurements_2": len(samples[2]),
            })  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    import torch

    report = {
        "what": "train.py samples (rows) per second, median of ThroughputMonitor's rolling values after warm-up",
        "setup": "tiny Qwen2.5-VL, synthetic task, per-process batch of the method's default config; "
        "1 process x 2 torch threads vs 2 DDP processes (gloo) x 1 thread, on the same 2 cores",
        "steps_per_run": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(), "results": results,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
