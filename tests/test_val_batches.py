"""Validation on several processes scores every row once (Lightning's DistributedSampler repeated some),
with every rank running as many batches (a step's collectives need every rank)."""

from __future__ import annotations

import pytest

from lightning_vlm.data.val_batches import ShardBatches


@pytest.mark.parametrize(
    ("length", "batch_size", "world"),
    [(7, 4, 2), (8, 2, 2), (17, 8, 2), (3, 1, 2), (5, 2, 3), (64, 8, 2), (9, 4, 1)],
)
def test_every_row_once_and_every_rank_as_many_batches(length, batch_size, world):
    shards = [list(ShardBatches(length, batch_size, world, r)) for r in range(world)]
    assert sorted(i for shard in shards for batch in shard for i in batch) == list(range(length))
    assert len({len(shard) for shard in shards}) == 1 and all(batch for shard in shards for batch in shard)
    assert all(len(batch) <= batch_size + 1 for shard in shards for batch in shard)
    assert all(len(ShardBatches(length, batch_size, world, r)) == len(shards[r]) for r in range(world))
    # batch k of all ranks together: the one-process batch of batch_size · world rows, as before
    if length % (batch_size * world) == 0:
        for k in range(len(shards[0])):
            rows = sorted(i for shard in shards for i in shard[k])
            assert rows == list(range(k * batch_size * world, (k + 1) * batch_size * world))


def test_fewer_rows_than_processes_is_refused_naming_both():
    with pytest.raises(ValueError, match="2 validation rows on 3 processes"):
        ShardBatches(2, 4, 3, 0)
    assert list(ShardBatches(0, 4, 2, 1)) == []
