"""The tests' torchrun launcher: a launch past its timeout is killed and says where each process hung."""

from __future__ import annotations

import time

from launch import start_torchrun, stop_with_stacks, torchrun

HANGS = """import sys, time
from pathlib import Path

def wait_for_a_server_that_never_answers():
    (Path(sys.argv[1]) / f"in-{__import__('os').environ['RANK']}").touch()
    time.sleep(600)

wait_for_a_server_that_never_answers()
"""


def test_a_stopped_launch_reports_where_each_worker_was(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    proc = start_torchrun(script, [str(tmp_path)])
    # both workers in the function (torchrun starts slowly on a busy machine)
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("in-*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    _, err = stop_with_stacks(proc)
    assert proc.returncode == -9
    # faulthandler's dump, one per worker: the function each was in
    assert err.count("in wait_for_a_server_that_never_answers") == 2, err[-3000:]


def test_a_launch_past_its_timeout_is_killed_and_says_so(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    proc = torchrun(script, [str(tmp_path)], timeout=1)
    assert proc.returncode == -9 and "[torchrun killed after 1 s" in proc.stderr
