"""The SFT warm start used by the learning tests: exported as an HF folder, loadable, better than random."""

from __future__ import annotations

import pytest

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.generation.base import SamplingSettings
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.models.vlm import VLM
from lightning_vlm.rewards.accuracy import answers_match


@pytest.mark.slow
def test_warm_start_exports_a_model_that_answers_better_than_chance(sft_warm_start):
    vlm = VLM(sft_warm_start())
    rows = synthetic_rows("prompt", 64, seed=1)
    out = HFGenerator(vlm).generate(
        rows, 1, SamplingSettings(max_new_tokens=4, temperature=0.0, do_sample=False)
    )
    accuracy = sum(
        answers_match(t, r["solution"]) for t, r in zip(out.completion_texts, rows, strict=True)
    ) / len(rows)
    assert accuracy > 0.3, accuracy  # chance is 1/8


@pytest.mark.slow
def test_the_build_is_the_same_whoever_starts_it(tmp_path, monkeypatch):
    # A caller with one thread (a rank of a 2-process test) builds the same weights as one with two: the
    # build pins its threads (measured before: 8e-5 apart, and the learning tests' figures moved), and
    # MKL's settings (its COMPATIBLE code path alone changes the 5-step weights, measured).
    from safetensors.torch import load_file

    from lightning_vlm.models import warm_start

    # 5 steps, not 80: without the pinning the two builds already differ after 5
    monkeypatch.setitem(warm_start.WARM_STARTS, "sft", warm_start.WarmStart(5, 1e-3))
    tiny_sft_path = warm_start.tiny_sft_path
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    one = tiny_sft_path("qwen2_5_vl", tmp_path / "one")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_CBWR")
    two = tiny_sft_path("qwen2_5_vl", tmp_path / "two")
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("start", ["sft", "sft_mixed"])
def test_every_config_file_a_build_composes_is_in_the_cache_key(start, tmp_path):
    # conf/method/_optimizer.yaml (the optimizer, weight decay), which sft.yaml includes, was not hashed:
    # a warm start built under another optimizer was reused.
    from pathlib import Path

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    from lightning_vlm.models import warm_start

    overrides = warm_start.build_overrides(
        "qwen2_5_vl", Path("/base"), tmp_path, warm_start.WARM_STARTS[start]
    )
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(warm_start.ROOT / "conf")))
    composed = loader.compute_defaults_list(config_name="train", overrides=overrides, run_mode=RunMode.RUN)
    files = {
        f"conf/{d.config_path}.yaml" for d in composed.defaults if d.config_path and d.primary is not None
    }
    files = {f for f in files if (warm_start.ROOT / f).is_file()}  # Hydra's own configs are not ours
    assert "conf/method/_optimizer.yaml" in files
    unhashed = {f for f in files if not any(f == s or f.startswith(f"{s}/") for s in warm_start._SOURCES)}
    assert not unhashed
