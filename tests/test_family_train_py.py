"""Online methods on non-Qwen families through ``train.py`` itself: a subprocess, 2 steps, exit 0, and
every step trained (a loss and a reward logged per step). Gemma 3 and LLaVA differ from Qwen in their
chat templates, end-of-turn tokens, image tokens and 1-D position ids."""

from __future__ import annotations

import csv

import pytest
from test_train import _run


@pytest.mark.slow  # a real train.py process each
@pytest.mark.parametrize(("model", "method"), [("tiny_gemma3", "grpo"), ("tiny_llava", "online_dpo")])
def test_train_py_runs_an_online_method_on_another_family(model, method, tmp_path):
    proc = _run(
        [f"method={method}", f"model={model}", "tiny_start=random", "logger=csv", "callbacks=none",
         "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
         "trainer.enable_progress_bar=false", "data.batch_size=2", "method.num_generations=2"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics_file,) = (tmp_path / "logs" / method / "runs").glob("*/csv/*/metrics.csv")
    with open(metrics_file) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1]
    assert all(r["train/reward"] != "" for r in rows)
