"""The learning tests stop running seeds once the median's verdict is settled (``helpers.reward_gains``):
that shortcut must give the verdict of the median over every seed, for every outcome."""

from __future__ import annotations

import itertools
import statistics

import pytest

from helpers import _median_settled


def _verdict_when_settled(gains: list[float], bar: float) -> bool:
    """The verdict the test asserts: the median of the gains run until the shortcut stops."""
    for k in range(1, len(gains) + 1):
        if _median_settled(gains[:k], bar, len(gains)):
            return statistics.median(gains[:k]) >= bar
    raise AssertionError(f"never settled: {gains}")


@pytest.mark.parametrize("seeds", [1, 2, 3, 4, 5])
def test_the_shortcut_gives_the_median_over_every_seed(seeds):
    # gains below, at and above the bar, in every order
    for gains in itertools.product([0.1, 0.2, 0.3], repeat=seeds):
        assert _verdict_when_settled(list(gains), 0.2) == (statistics.median(gains) >= 0.2), gains


def test_three_seeds_stop_after_two_that_agree():
    assert _median_settled([0.5, 0.4], 0.2, 3) and _median_settled([0.0, 0.1], 0.2, 3)
    assert not _median_settled([0.5, 0.1], 0.2, 3) and not _median_settled([0.5], 0.2, 3)
    assert _median_settled([0.5, 0.1, 0.3], 0.2, 3)
