"""Resuming from a mid-epoch checkpoint continues the same run: same data position, same weights."""

from __future__ import annotations

import pytest
import torch

from helpers import compose_train
from lightning_vlm.data.resumable import ResumableDataLoader
from lightning_vlm.training import train

COMMON = [
    "logger=none",
    "callbacks=none",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.synthetic.num_train=64",  # 16 batches an epoch: step 5 is mid-epoch
]


def _weights(out) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out["module"].vlm.model.named_parameters()}


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "lora_dropout"])
def test_resume_mid_epoch_matches_an_uninterrupted_run(tmp_path, dropout):
    # With dropout, the random-number states must resume too (Lightning saves none): masks differed.
    extra = ["lora=default", "model.lora.lora_dropout=0.1"] if dropout else []
    _, straight = train(compose_train([*COMMON, *extra, "trainer.max_steps=10"], tmp_path / "a"))
    ckpt_dir = tmp_path / "b" / "ckpt"
    first = [
        *COMMON,
        *extra,
        # A checkpoint taken mid-run (step 5 of 7), as a crash would leave it.
        "trainer.max_steps=7",
        "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.ckpt.dirpath={ckpt_dir}",
        "+callbacks.ckpt.every_n_train_steps=5",
        "+callbacks.ckpt.filename=mid",
    ]
    train(compose_train(first, tmp_path / "b"))
    state = torch.load(ckpt_dir / "mid.ckpt", weights_only=True)  # plain containers only
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 5
    _, resumed = train(
        compose_train(
            [*COMMON, *extra, "trainer.max_steps=10", f"ckpt_path={ckpt_dir / 'mid.ckpt'}"], tmp_path / "c"
        )
    )
    a, b = _weights(straight), _weights(resumed)
    assert resumed["trainer"].global_step == 10
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_epoch_order_depends_on_seed_and_epoch_only():
    loader = ResumableDataLoader(list(range(10)), batch_size=3, seed=7, collate_fn=list)
    loader.sampler.set_epoch(2)
    full = list(loader)
    loader.load_state_dict({"epoch": 2, "batches": 2})
    assert list(loader) == full[2:]
    loader.sampler.set_epoch(3)
    assert list(loader) != full


def _epoch(loader) -> list[int]:
    return [i for batch in loader for i in batch]


def test_ranks_get_disjoint_shards_that_make_up_the_one_process_order():
    one = ResumableDataLoader(list(range(11)), batch_size=4, seed=3, collate_fn=list)
    ranks = [ResumableDataLoader(list(range(11)), batch_size=2, seed=3, num_replicas=2, rank=r, collate_fn=list)
             for r in (0, 1)]  # fmt: skip
    for loader in (one, *ranks):
        loader.sampler.set_epoch(1)
    order, shards = _epoch(one), [_epoch(r) for r in ranks]
    # 11 rows on 2 ranks: padded to 12 by wrapping around (as DistributedSampler), so both get 6
    assert len(shards[0]) == len(shards[1]) == 6
    assert shards[0] == order[0::2] and shards[1] == order[1::2] + order[:1]
    assert sorted(set(shards[0]) | set(shards[1])) == list(range(11))


def test_every_rank_gets_as_many_rows_when_there_are_fewer_rows_than_ranks():
    from lightning_vlm.data.resumable import EpochSeededSampler

    shards = [list(EpochSeededSampler(1, num_replicas=3, rank=r)) for r in range(3)]
    assert shards == [[0], [0], [0]]  # rank 2 got nothing: the others waited for it in a collective
    shards = [list(EpochSeededSampler(2, num_replicas=5, rank=r, shuffle=False)) for r in range(5)]
    assert shards == [[0], [1], [0], [1], [0]]
    assert all(len(EpochSeededSampler(2, num_replicas=5, rank=r)) == 1 for r in range(5))


def test_a_checkpoint_on_the_last_batch_of_an_epoch_does_not_shorten_the_next():
    loader = ResumableDataLoader(list(range(8)), batch_size=4, seed=0, collate_fn=list)
    loader.sampler.set_epoch(0)
    assert len(_epoch(loader)) == 8
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 2, "samples": 8, "world_size": 1, "batch_size": 4, "length": 8,
                     "seed": 0, "shuffle": True}  # fmt: skip
    resumed = ResumableDataLoader(list(range(8)), batch_size=4, seed=0, collate_fn=list)
    resumed.load_state_dict(state)
    assert _epoch(resumed) == []  # epoch 0 was complete
    resumed.sampler.set_epoch(1)
    fresh = ResumableDataLoader(list(range(8)), batch_size=4, seed=0, collate_fn=list)
    fresh.sampler.set_epoch(1)
    assert _epoch(resumed) == _epoch(fresh)  # epoch 1 whole, not cut by epoch 0's position


def test_a_loaded_position_is_saved_again_before_the_first_batch():
    # A checkpoint can be written between the restore and the resumed run's first batch (Lightning checks
    # for SIGTERM at the top of a batch; a resumed validation runs first). It reported sample 0, so the
    # next resume trained the epoch's start twice and never its end.
    state = {"epoch": 1, "batches": 3, "samples": 6, "world_size": 1, "batch_size": 2, "length": 10, "seed": 0,
             "shuffle": True}  # fmt: skip
    resumed = ResumableDataLoader(list(range(10)), batch_size=2, seed=0, collate_fn=list)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    again = ResumableDataLoader(list(range(10)), batch_size=2, seed=0, collate_fn=list)
    again.load_state_dict(resumed.state_dict())
    fresh = ResumableDataLoader(list(range(10)), batch_size=2, seed=0, collate_fn=list)
    fresh.sampler.set_epoch(1)
    assert _epoch(again) == _epoch(fresh)[6:]
    # a loaded position of a finished epoch says nothing of the next one
    resumed.load_state_dict({**state, "batches": 5, "samples": 10})
    resumed.sampler.set_epoch(2)
    assert resumed.state_dict() == {**state, "epoch": 2, "batches": 0, "samples": 0}


def test_a_resume_on_edited_data_or_another_seed_warns(caplog):
    # The saved position counts samples of the checkpoint's order: other rows or another seed make another
    # order, so the rest of the epoch would repeat some rows and skip others without a word.
    loader = ResumableDataLoader(list(range(10)), batch_size=2, seed=0, collate_fn=list)
    next(iter(loader))
    state = loader.state_dict()
    for rows, seed, said in ((10, 0, None), (12, 0, "training rows 10 -> 12"), (10, 3, "seed 0 -> 3")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            ResumableDataLoader(list(range(rows)), batch_size=2, seed=seed, collate_fn=list).load_state_dict(
                state
            )
        warned = [m for m in caplog.messages if "resuming on other data" in m]
        assert (said in warned[0]) if said else not warned, (said, caplog.messages)
    with caplog.at_level("WARNING"):  # a checkpoint of an earlier version holds none of them: no warning
        old = {k: v for k, v in state.items() if k not in ("length", "seed", "shuffle")}
        ResumableDataLoader(list(range(12)), batch_size=2, collate_fn=list).load_state_dict(old)
    assert not [m for m in caplog.messages if "resuming on other data" in m and "12" in m]


def test_a_two_process_position_continues_on_one_process_with_a_warning(caplog):
    ranks = [ResumableDataLoader(list(range(12)), batch_size=2, seed=5, num_replicas=2, rank=r, collate_fn=list)
             for r in (0, 1)]  # fmt: skip
    seen = []
    for loader in ranks:
        it = iter(loader)
        seen += next(it) + next(it)  # two batches of two on each rank: 8 of 12 rows
    state = ranks[0].state_dict()
    assert state["samples"] == 8 and state["world_size"] == 2
    one = ResumableDataLoader(list(range(12)), batch_size=4, seed=5, collate_fn=list)
    with caplog.at_level("WARNING"):
        one.load_state_dict(state)
    assert any("written by 2 processes at" in m and "with 1 processes at" in m for m in caplog.messages)
    rest = _epoch(one)
    assert sorted(seen + rest) == list(range(12))


def _checkpoint_at(step: int, folder):
    """A run of COMMON (batches of 4) stopped at ``step``, with its checkpoint there; returns that file."""
    ckpt_dir = folder / "ckpt"
    overrides = [*COMMON, f"trainer.max_steps={step}",
                 "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint", f"+callbacks.ckpt.dirpath={ckpt_dir}",
                 f"+callbacks.ckpt.every_n_train_steps={step}", "+callbacks.ckpt.filename=mid"]  # fmt: skip
    train(compose_train(overrides, folder))
    return ckpt_dir / "mid.ckpt"


def test_a_resume_with_a_larger_batch_trains_the_rest_of_the_epoch(tmp_path, caplog):
    """Lightning counts an epoch's batches; the loader counts samples. A resume with another global batch
    (``data.batch_size``, or more processes) used to end the epoch when Lightning's count, carried over
    from the old batch size, reached the new epoch length: here after 3 of the 6 batches left."""
    mid = _checkpoint_at(5, tmp_path / "a")  # 20 of 64 rows
    resume = [
        *COMMON,
        "data.batch_size=8",
        "trainer.max_steps=-1",
        "trainer.max_epochs=1",
        f"ckpt_path={mid}",
    ]
    with caplog.at_level("WARNING"):
        _, resumed = train(compose_train(resume, tmp_path / "b"))
    # the 44 rows left, in batches of 8: 5 whole ones and a last of 4
    assert resumed["trainer"].global_step == 5 + 6
    assert resumed["trainer"].train_dataloader.state_dict()["samples"] == 64
    assert any("at 4 rows a step with 1 processes at 8 rows a step" in r.getMessage() for r in caplog.records)


def test_a_resume_with_a_larger_batch_steps_the_epoch_s_last_micro_batch(tmp_path):
    # 12 of 64 rows done, 52 left in batches of 8: 7 batches, Lightning told 1 of 8 is done. Rounded down
    # to whole accumulations (0 done), Lightning expected 8 batches, so the loader ran out before the
    # epoch's end: the 7th batch's gradient was never stepped (and zeroed at the next epoch).
    mid = _checkpoint_at(3, tmp_path / "a")
    resume = [*COMMON, "data.batch_size=8", "trainer.accumulate_grad_batches=2", "trainer.max_steps=-1",
              "trainer.max_epochs=1", f"ckpt_path={mid}"]  # fmt: skip
    _, resumed = train(compose_train(resume, tmp_path / "b"))
    # windows [1], [2, 3], [4, 5], [6, 7] of Lightning's count: the first finishes the interrupted one
    assert resumed["trainer"].global_step == 3 + 4
    assert resumed["trainer"].train_dataloader.state_dict()["samples"] == 64


def test_the_batch_count_after_a_resume_follows_limit_train_batches(tmp_path):
    # limit_train_batches=4 cut the count the repair compared with the loader's whole epoch: 0 batches
    # counted done, so the resumed epoch ran 4 more batches of 8 instead of the 3 its limit leaves.
    mid = _checkpoint_at(2, tmp_path / "a")  # 8 of 64 rows
    resume = [*COMMON, "data.batch_size=8", "trainer.max_steps=-1", "trainer.max_epochs=1",
              "trainer.limit_train_batches=4", f"ckpt_path={mid}"]  # fmt: skip
    _, resumed = train(compose_train(resume, tmp_path / "b"))
    assert resumed["trainer"].global_step == 2 + 3  # the 8 rows done are one batch of 8 of the 4 allowed


def test_a_checkpoint_after_set_epoch_and_before_the_first_batch_keeps_that_epoch_whole():
    # Under DDP Lightning checks for SIGTERM at the top of each step: after set_epoch(e + 1), before the
    # first fetch. The state paired epoch e + 1 with epoch e's consumed count, and the resume skipped it.
    loader = ResumableDataLoader(
        list(range(10)), batch_size=2, seed=0, num_replicas=2, rank=0, collate_fn=list
    )
    loader.sampler.set_epoch(0)
    _epoch(loader)
    loader.sampler.set_epoch(1)
    iter(loader)  # Lightning's fetcher takes the iterator; no batch drawn yet
    state = loader.state_dict()
    assert (state["epoch"], state["samples"], state["batches"]) == (1, 0, 0)
    resumed = ResumableDataLoader(
        list(range(10)), batch_size=2, seed=0, num_replicas=2, rank=0, collate_fn=list
    )
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    fresh = ResumableDataLoader(
        list(range(10)), batch_size=2, seed=0, num_replicas=2, rank=0, collate_fn=list
    )
    fresh.sampler.set_epoch(1)
    assert _epoch(resumed) == _epoch(fresh) != []
