"""Steps and micro-batches of one generation on every rank (methods/step_layout.py), by hand.

Equal shards keep the plain layout (consecutive micro-batches of ``micro_batch_size``); a rank that
holds fewer completions (rows skipped at load) must still run as many optimizer steps and forward
passes as the others, or FSDP's gathers and the top-entropy quantile would leave them waiting.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_vlm.methods.step_layout import index_chunks, micro_counts, rank_chunks


def ids(chunks: list[list[torch.Tensor]]) -> list[list[list[int]]]:
    return [[m.tolist() for m in step] for step in chunks]


def test_pairs_stay_whole_in_steps_and_micro_batches():
    # Online DPO's 3 pairs in 4 steps: 3 steps of one pair (not [2, 2, 1, 1] completions, which split pairs)
    assert ids(index_chunks(6, 4, None, unit=2)) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    # 4 pairs, 1 step, micro-batches of 2 completions: one pair each
    assert ids(index_chunks(8, 1, 2, unit=2)) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="whole units of 2"):
        index_chunks(5, 1, None, unit=2)


def test_equal_shards_keep_the_plain_layout():
    for n, steps, size in itertools.product(range(1, 13), range(1, 5), (None, 1, 2, 3, 5)):
        assert ids(rank_chunks([n, n], 1, steps, size)) == ids(index_chunks(n, steps, size))


def test_a_short_rank_runs_the_same_steps_and_forward_passes():
    # 8 and 6 completions, micro-batches of 2: rank 0 needs 4 passes, rank 1 splits its 6 into 4
    assert micro_counts([8, 6], 1, 2) == [4]
    assert ids(rank_chunks([8, 6], 0, 1, 2)) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert ids(rank_chunks([8, 6], 1, 1, 2)) == [[[0, 1], [2, 3], [4], [5]]]
    # steps are bounded by the shortest rank: 2 steps, though 4 were asked for
    assert [len(s) for s in rank_chunks([8, 2], 0, 4, None)] == [1, 1]
    # a micro-batch cannot be empty: a rank of 1 completion allows one pass, so rank 0's holds all 8
    assert ids(rank_chunks([8, 1], 0, 1, 2)) == [[list(range(8))]]


@pytest.mark.parametrize("unit", [1, 2])
def test_every_layout_agrees_across_ranks_and_trains_each_completion_once(unit):
    for sizes in itertools.product(range(1, 9), repeat=3):
        sizes = [unit * n for n in sizes]
        for steps, size in itertools.product((1, 2, 3, 4), (None, 2, 3, 4)):
            layouts = [rank_chunks(sizes, r, steps, size, unit) for r in range(len(sizes))]
            shape = [len(step) for step in layouts[0]]
            for n, chunks in zip(sizes, layouts, strict=True):
                assert [len(step) for step in chunks] == shape  # same steps, same passes in each
                flat = torch.cat([m for step in chunks for m in step]).tolist()
                assert flat == list(range(n))  # each completion once, in order
                assert all(len(m) > 0 and len(m) % unit == 0 for step in chunks for m in step)
            if size is None:
                continue
            for s in range(len(shape)):
                # A step keeps micro_batch_size on every rank unless the shortest rank holds fewer units
                # in it than another rank needs passes (then passes cannot all be that small and non-empty).
                units = [sum(len(m) for m in chunks[s]) // unit for chunks in layouts]
                needed = max(-(-u // max(size // unit, 1)) for u in units)
                if min(units) >= needed:
                    assert all(len(m) <= max(size, unit) for chunks in layouts for m in chunks[s])
                else:
                    assert shape[s] == min(units)
