"""Time and peak memory of one training step, on a GPU or on the CPU, for the benchmarks here.

Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the rise of the process's resident set
high-water mark (VmHWM, reset through /proc/self/clear_refs) above its resident size before the step,
with glibc told to return large blocks to the OS (``mmap_large_blocks``; else freed memory hides the next
peak).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path


def mmap_large_blocks() -> None:
    """Re-run this script with big tensors allocated via mmap and unmapped on free, so the resident set
    follows the live tensors. Call it before importing torch."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform == "linux":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def timed_peak(step: Callable[[], object], device) -> tuple[float, float]:
    """Seconds and peak extra bytes of ``step()`` on ``device`` (a ``torch.device``)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
        base = _status("VmRSS:")
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status("VmHWM:")
    return time.perf_counter() - start, float(peak - base)


def add_medians(
    row: dict, samples: dict[str, list[tuple[float, float]]], slow: str, fast: str, ratio: str | None = None
) -> dict:
    """``row`` with each path's median step seconds and peak MiB (and every step's seconds) from its
    (seconds, bytes) ``samples``, and the ``slow`` path's time and memory over the ``fast`` one's (keys
    ``*_ratio_<ratio>``, by default ``<slow>_over_<fast>``); printed."""
    ratio = ratio or f"{slow}_over_{fast}"
    import json
    import statistics

    for path, values in samples.items():
        row[f"{path}_step_s_median"] = statistics.median(t for t, _ in values)
        row[f"{path}_peak_mib_median"] = statistics.median(m for _, m in values) / 2**20
        row[f"{path}_step_s_all"] = [round(t, 5) for t, _ in values]
    row[f"time_ratio_{ratio}"] = row[f"{slow}_step_s_median"] / row[f"{fast}_step_s_median"]
    row[f"memory_ratio_{ratio}"] = row[f"{slow}_peak_mib_median"] / max(row[f"{fast}_peak_mib_median"], 1e-9)
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    return row


def write_report(out: str, what: str, device, threads: int, repeats: int, results: list[dict]) -> None:
    """The benchmark's JSON at ``out``: what was measured, where, with which versions, and the results."""
    import json
    import platform

    import torch

    report = {
        "what": what,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({threads} threads)",
        "memory": "cuda max_memory_allocated" if device.type == "cuda" else "VmHWM rise over VmRSS",
        "repeats": repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "results": results,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
