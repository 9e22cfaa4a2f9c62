"""Warnings about rows that come back batch after batch (pairs that render alike, answers cut away by
``max_length``): said at the 1st, 2nd, 4th, 8th, ... batch that has them, with the count so far.

A dataset with many such rows would otherwise repeat one warning at every step of every epoch and bury
the rest of the log; doubling keeps a handful a run, and each says how often it has happened. The counts
start again with each run (``training.build``: train.py and eval.py), so a sweep's next job warns afresh.
"""

from __future__ import annotations

import logging
from collections import Counter

_seen: Counter[str] = Counter()


def warn_recurring(
    logger: logging.Logger, kind: str, message: str, *args: object, unit: str = "batch"
) -> None:
    """Logs ``message % args`` as a warning the 1st, 2nd, 4th, ... time a batch (or other ``unit``) has
    this ``kind`` of row."""
    _seen[kind] += 1
    n = _seen[kind]
    if n & (n - 1) == 0:  # a power of two
        later = (
            "" if n == 1 else f" [{unit} {n} so far with this warning; it is said again at {unit} {2 * n}]"
        )
        logger.warning(message + later, *args)


def reset_recurring() -> None:
    """Starts every count again (a new training run)."""
    _seen.clear()
