"""DPO's reference precompute stopped part-way (a preemption, an error): the rows done are kept on disk, and
a run that finds the folder again computes only the rest."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from helpers import compose_train
from lightning_vlm.methods import dpo
from lightning_vlm.methods.dpo import DPO
from lightning_vlm.methods.reference_cache import ReferenceLogpCache
from lightning_vlm.training import train

# 16 train and 4 val rows in batches of 4: a precompute of 5 batches.
RUN = [
    "method=dpo",
    "logger=none",
    "callbacks=none",
    "trainer.max_steps=2",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.val_batch_size=4",
    "data.synthetic.num_train=16",
    "data.synthetic.num_val=4",
    "method.precompute_ref_logps=true",
]


def _stored(folder) -> int:
    """Rows whose values are on disk."""
    return len(ReferenceLogpCache(folder, "*"))


def _count_computed(monkeypatch, on_call=None) -> list[int]:
    """Records the rows of every reference forward; ``on_call(n)`` runs at the n-th."""
    computed: list[int] = []
    compute = DPO._compute_ref

    def counted(self, batch):
        computed.append(len(batch.completion_mask) // 2)
        if on_call is not None:
            on_call(len(computed))
        return compute(self, batch)

    monkeypatch.setattr(DPO, "_compute_ref", counted)
    return computed


def test_sigterm_during_the_precompute_keeps_the_rows_done_and_a_rerun_computes_the_rest(
    tmp_path, monkeypatch, caplog
):
    # SIGTERM came before Lightning registers its handlers (they follow on_fit_start): the default action
    # ended the process at once, and the precomputed values, saved only at the end, were all lost.
    folder = tmp_path / "ref"
    run = [*RUN, f"method.ref_cache_dir={folder}"]

    def preempt(n: int) -> None:
        if n == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    computed = _count_computed(monkeypatch, preempt)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"), pytest.raises(SystemExit) as stop:
        train(compose_train(run, tmp_path / "a"))
    assert stop.value.code == 128 + signal.SIGTERM  # a scheduler requeues it
    assert computed == [4, 4], "stopped at the end of the batch the signal came in"
    assert _stored(folder) == 8
    assert f"the values of 8 rows are kept in {folder}" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not None  # a handler was restored, not left dangling

    monkeypatch.undo()  # no signal this time
    computed = _count_computed(monkeypatch)
    train(compose_train(run, tmp_path / "b"))
    assert computed == [4, 4, 4], "only the 8 train and 4 val rows not stored yet"
    assert _stored(folder) == 20


def test_the_precompute_saves_as_it_goes_and_on_an_error(tmp_path, monkeypatch):
    folder = tmp_path / "ref"
    saved: list[int] = []
    save = ReferenceLogpCache.save

    def recorded(self):
        if self.dirty:
            saved.append(len(self.values))
        save(self)

    monkeypatch.setattr(ReferenceLogpCache, "save", recorded)
    monkeypatch.setattr(dpo, "REF_SAVE_EVERY_S", 0.0)  # a save after every batch

    def fail(n: int) -> None:
        if n == 4:
            raise RuntimeError("out of memory on a long row")

    _count_computed(monkeypatch, fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(compose_train([*RUN, f"method.ref_cache_dir={folder}"], tmp_path))
    assert saved == [4, 8, 12] and _stored(folder) == 12
