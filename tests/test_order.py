"""The order test files are handed out in (``order.py``): longest first, from measured durations."""

from __future__ import annotations

import json

from order import DURATIONS, file_durations, longest_files_first

from helpers import ROOT


def test_durations_are_summed_per_file_from_a_junit_report(tmp_path):
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "tests" / name).write_text("")
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_one" time="1.5"/>'
        '<testcase classname="tests.test_b" name="test_two[x]" time="4.0"/>'
        '<testcase classname="tests.test_a.TestGroup" name="test_three" time="2.0"/>'
        '<testcase classname="tests.test_gone" name="test_four" time="9.0"/>'
        "</testsuite></testsuites>"
    )
    durations = file_durations(report, root=tmp_path)
    assert durations == {"tests/test_b.py": 4.0, "tests/test_a.py": 3.5}
    assert list(durations) == ["tests/test_b.py", "tests/test_a.py"]  # longest first


def test_longest_files_go_first_and_ties_keep_their_order():
    ids = [
        "tests/a.py::t1",
        "tests/b.py::t1",
        "tests/a.py::t2",
        "tests/c.py::t",
        "tests/new.py::t",
        "tests/b.py::t2",
    ]
    durations = {"tests/a.py": 5.0, "tests/b.py": 60.0, "tests/c.py": 5.0}
    order = [ids[i] for i in longest_files_first(ids, durations)]
    assert order == ["tests/b.py::t1", "tests/b.py::t2", "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t",
                     "tests/new.py::t"]  # fmt: skip


def test_the_measured_durations_name_test_files_that_exist():
    stale = [path for path in json.loads(DURATIONS.read_text()) if not (ROOT / path).is_file()]
    assert not stale, f"tests/durations.json names files that are gone: {stale} (refresh it: tests/order.py)"
