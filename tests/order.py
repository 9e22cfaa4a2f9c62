"""The order pytest-xdist hands out test files in: longest first, by their measured durations.

``make test`` runs files on two workers (``--dist loadfile``), each worker holding one file queued
ahead. By default xdist hands out the files with the most tests first, so the learning files (a few
tests of minutes each) came late, and one handed out last kept one worker busy while the other idled.
Simulated on the durations measured for ``durations.json`` over 200 shuffled orders, the suite's wall
time was 36.3 min (median), 38.1 (9 in 10) and 39.0 (worst) in that order, against 35.7 longest first,
which is also the even split. The Makefile turns xdist's own reordering off
(``--no-loadscope-reorder``). Files keep their shuffled order among themselves where their durations
tie (files not measured count 0 and go last); tests keep theirs within a file.

Refresh the durations after adding slow tests (the order only; nothing depends on the values)::

    make test ARGS="--junitxml=/tmp/junit.xml" && .venv/bin/python tests/order.py /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")


def file_durations(junit_xml: str | Path, root: Path = Path(__file__).parents[1]) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests) from a pytest JUnit XML report,
    keyed by the file's path from ``root`` as in a node id; longest first."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # "tests.test_x" or "tests.test_x.TestClass": the longest prefix that names a file
        path = next((p for i in range(len(parts), 0, -1) if (root / (p := "/".join(parts[:i]) + ".py")).is_file()),
                    None)  # fmt: skip
        if path is not None:
            totals[path] += float(case.get("time", 0.0))
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def longest_files_first(nodeids: list[str], durations: dict[str, float]) -> list[int]:
    """The positions of ``nodeids`` reordered: longest file first, a stable sort (ties keep their order)."""
    return sorted(range(len(nodeids)), key=lambda i: -durations.get(nodeids[i].split("::")[0], 0.0))


if __name__ == "__main__":
    DURATIONS.write_text(json.dumps(file_durations(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {DURATIONS}")
