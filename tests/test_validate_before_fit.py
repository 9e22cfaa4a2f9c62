"""``validate_before_fit=true`` with nothing to validate: refused with ``trainer.limit_val_batches=0``
(test_bad_input_settings.py's matrix), said and trained on without validation rows."""

from __future__ import annotations

import logging

from test_bad_input_data import sft_row, write_rows
from test_bad_input_settings import SMALL

from helpers import compose_train
from lightning_vlm.training import train


def test_validate_before_fit_without_validation_rows_says_so_and_trains(tmp_path, caplog):
    # A file without data.val or data.val_fraction has no validation; the first validation returned no
    # metrics and training.py failed on them (IndexError) after the model had loaded.
    train_file = write_rows(tmp_path, [sft_row() for _ in range(4)])
    cfg = compose_train([*SMALL, f"data.train={train_file}", "validate_before_fit=true"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        _, out = train(cfg)
    assert out["initial_metrics"] == {}
    assert out["trainer"].global_step == 1
    assert "validate_before_fit=true: the data has no validation rows" in caplog.text
