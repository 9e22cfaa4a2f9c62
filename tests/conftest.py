"""Shared, session-scoped fixtures: tiny models are built once per session (and cached on disk)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from order import DURATIONS, longest_files_first

# Two cores here and in CI, shared by the pytest-xdist workers (`make test` starts two): more threads
# than cores only add contention (oversubscribed OpenMP threads spin), so each worker and the processes
# its tests start (OMP_NUM_THREADS) get their share of the two.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = os.environ.get("LIGHTNING_VLM_TEST_THREADS", str(max(1, 2 // _WORKERS)))
torch.set_num_threads(int(_THREADS))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_path():
    """Returns a function family -> folder of that family's tiny VLM (built once, cached)."""
    from lightning_vlm.models.tiny import tiny_vlm_path

    cache: dict[str, str] = {}

    def get(family: str = "qwen2_5_vl") -> str:
        if family not in cache:
            cache[family] = str(tiny_vlm_path(family))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def vlms(tiny_path):
    """Returns a function family -> that family's tiny VLM as built by default (one per module)."""
    from lightning_vlm.models.vlm import VLM

    cache: dict[str, VLM] = {}

    def get(family: str) -> VLM:
        if family not in cache:
            cache[family] = VLM(tiny_path(family))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def sft_warm_start():
    """Returns a function -> folder of the tiny Qwen2.5-VL's SFT warm start: the one the default online
    and preference jobs start from (``tiny_start=sft``), built once by train.py and cached on disk,
    keyed by the tiny recipe and the training code (``lightning_vlm/models/warm_start.py``)."""
    from lightning_vlm.models.warm_start import tiny_sft_path

    return lambda family="qwen2_5_vl": str(tiny_sft_path(family))


def pytest_collection_modifyitems(config, items) -> None:
    """Longest test files first (after pytest-randomly's shuffle, which wraps this hook): see ``order.py``."""
    durations = json.loads(DURATIONS.read_text())
    items[:] = [items[i] for i in longest_files_first([item.nodeid for item in items], durations)]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The shuffled order's seed, also under ``-q`` (which hides pytest-randomly's header line)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(
            f"test order: pytest-randomly seed {seed}; --randomly-seed={seed} replays it"
        )
