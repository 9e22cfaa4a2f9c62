"""Sharded checkpoints (FSDP's folders) are replaced whole: a kill in the middle of a save keeps the
previous ``last.ckpt`` as it was (``lightning_vlm/parallel/folder_swap.py``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from _fsdp_killed_save import digests
from launch import torchrun
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import ROOT
from lightning_vlm.checkpoint_io import temp_name
from lightning_vlm.ckpt_path import check_ckpt_path, checkpoint_to_load
from lightning_vlm.parallel import folder_swap
from lightning_vlm.parallel.folder_swap import swap_in


def _folder(path, **files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(folder):
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2_exchange", "two_renames"])
def test_swap_in_replaces_a_folder_or_file_whole_and_leaves_nothing_beside_it(
    tmp_path, monkeypatch, exchange
):
    if not exchange:  # NFS and other filesystems without RENAME_EXCHANGE
        monkeypatch.setattr(folder_swap, "_exchange", lambda a, b: False)
    target = _folder(tmp_path / "last.ckpt", **{"meta.pt": "old", "__0_0.distcp": "old shard"})
    killed = _folder(temp_name(target), **{"__0_0.distcp": "half"})  # a save killed before its swap
    new = _folder(temp_name(target), **{"meta.pt": "new", "__0_0.distcp": "new shard"})
    swap_in(new, target)
    assert _contents(target) == {"meta.pt": "new", "__0_0.distcp": "new shard"}
    assert not killed.exists() and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    # a single-file last.ckpt (written without FSDP) is replaced by the folder too
    (file := tmp_path / "other.ckpt").write_text("file")
    swap_in(_folder(temp_name(file), **{"meta.pt": "folder"}), file)
    assert _contents(file) == {"meta.pt": "folder"}


def test_a_swap_killed_between_its_renames_names_the_checkpoint_it_kept(tmp_path):
    # Without RENAME_EXCHANGE the old folder moves aside first; killed then, no last.ckpt is left, and
    # ckpt_path=last would have started from the initial weights without a word.
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    aside = _folder(checkpoints / ".last.ckpt.0123456789ab.old", **{"meta.pt": "old"})
    with pytest.raises(FileNotFoundError, match=rf"is kept as {aside}: move it back"):
        check_ckpt_path(str(checkpoints / "last.ckpt"))
    trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=checkpoints)])
    with pytest.raises(FileNotFoundError, match=rf"ckpt_path=last: no .*last.ckpt; .* kept as {aside}"):
        checkpoint_to_load("last", trainer, resuming=True)


@pytest.mark.slow
@pytest.mark.ddp
def test_a_kill_during_a_sharded_save_keeps_the_previous_last_ckpt(tiny_path, tmp_path):
    # Lightning wrote the new shards into last.ckpt/ itself (each file emptied, then written): killed
    # there, the step-2 checkpoint was gone and no complete one was left to resume.
    tiny_path()  # built here, so the processes only read the cache
    proc = torchrun(ROOT / "tests" / "_fsdp_killed_save.py", [str(tmp_path)], timeout=600)
    assert proc.returncode != 0, "the run was to be killed in its step-4 save"
    step2 = json.loads((tmp_path / "step2.json").read_text())
    assert len([f for f in step2 if f.endswith(".distcp")]) == 2 and "meta.pt" in step2
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert digests(last) == step2, proc.stderr[-3000:]
    # what the killed save wrote is left in a hidden folder beside it, removed by the next save
    assert [p for p in os.listdir(last.parent) if not p.startswith(".")] == ["last.ckpt"]
