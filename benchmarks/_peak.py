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
