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
