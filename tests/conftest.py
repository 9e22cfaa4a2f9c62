"""Shared, session-scoped fixtures: tiny models are built once per session (and cached on disk)."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores here and in CI: more threads only add contention.
torch.set_num_threads(int(os.environ.get("LIGHTNING_VLM_TEST_THREADS", "2")))
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


@pytest.fixture(scope="session")
def sft_warm_start(tmp_path_factory):
    """Returns a function steps -> folder of the tiny Qwen2.5-VL after `steps` SFT steps on the
    synthetic task (seed 0): the shared warm start of the preference and online-RL learning tests.

    Built once per session and per `steps`, and cached on disk under the tiny-model cache keyed by
    the tiny recipe, so repeated test runs reuse it.
    """
    from helpers import compose_train
    from lightning_vlm.models.tiny import default_cache_dir, recipe_hash
    from lightning_vlm.training import train

    built: dict[int, str] = {}

    def get(steps: int = 80, lr: float = 1e-3) -> str:
        if steps in built:
            return built[steps]
        key = f"sft-warm-{recipe_hash('qwen2_5_vl', 0)}-s{steps}-lr{lr:g}-v1"
        out = default_cache_dir() / key
        if not (out / "config.json").is_file():
            tmp = tmp_path_factory.mktemp(key)
            cfg = compose_train(
                [
                    "logger=none",
                    "callbacks=none",
                    f"trainer.max_steps={steps}",
                    f"trainer.val_check_interval={steps}",
                    "trainer.limit_val_batches=0",
                    "trainer.enable_progress_bar=false",
                    f"method.optimizer.lr={lr}",
                    "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                    f"+callbacks.export.dirpath={tmp / 'model'}",
                ],
                tmp,
            )
            train(cfg)
            out.parent.mkdir(parents=True, exist_ok=True)
            if not (out / "config.json").is_file():
                os.replace(tmp / "model", out)  # atomic: concurrent sessions never see half a folder
        built[steps] = str(out)
        return built[steps]

    return get
