"""The tests' torchrun launcher: a launch past its timeout is killed and says where each process hung."""

from __future__ import annotations

from launch import torchrun


def test_a_launch_past_its_timeout_reports_each_worker_s_stack(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text("import time\n\ndef wait_for_a_server_that_never_answers():\n    time.sleep(600)\n\n"
                      "wait_for_a_server_that_never_answers()\n")  # fmt: skip
    proc = torchrun(script, [], timeout=20)
    assert proc.returncode == -9
    assert "[torchrun killed after 20 s" in proc.stderr
    # faulthandler's dump, one per worker: the function each was in
    assert proc.stderr.count("in wait_for_a_server_that_never_answers") == 2, proc.stderr[-3000:]
