"""Starting the server the callback owns (``serving.process.launch_server``), for real: a server that
dies while loading fails at once with its log's tail, a port taken between picking it and vLLM
binding it is retried on another port, and a server stops when the process that started it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from lightning_vlm.generation.vllm_server_client import VLLMServerClient
from lightning_vlm.serving import process
from lightning_vlm.serving.process import (
    STOP_WITH_PID,
    ServerStartError,
    launch_server,
    log_tail,
    stop_server,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def healthy(url: str) -> bool:
    return VLLMServerClient(url, connect_timeout=2.0).health()


def test_a_server_that_exits_while_starting_fails_at_once_with_its_log(tmp_path):
    log = tmp_path / "run" / "vllm_server.log"
    # The deadline is far away: the error must come from the exit, not from waiting it out.
    with pytest.raises(ServerStartError, match=r"exited with code [1-9]") as info:
        launch_server(str(tmp_path / "no-such-model"), [], log, wait=3600.0, healthy=healthy)
    assert f"last lines of {log}" in str(info.value) and "no-such-model" in str(info.value)


def test_a_port_taken_before_vllm_binds_it_is_retried_on_another(tiny_path, tmp_path, monkeypatch, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = process.free_port
        monkeypatch.setattr(process, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
        log = tmp_path / "vllm_server.log"
        proc, url = launch_server(tiny_path("qwen2_5_vl"), [], log, wait=600.0, healthy=healthy)
    try:
        assert url != f"http://127.0.0.1:{busy}" and healthy(url)
        assert "Address already in use" in log.read_text()  # the first attempt's exit, kept in the log
        assert "was taken before it bound it; retrying on another" in caplog.text
    finally:
        stop_server(proc)


def test_the_log_tail_is_this_attempts_lines(tmp_path):
    log = tmp_path / "vllm_server.log"
    assert log_tail(log) == ""
    log.write_text("Address already in use (an earlier attempt)\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("loading\nout of memory\n")
    assert log_tail(log, start) == "loading\nout of memory"
    assert log_tail(log, start, lines=1) == "out of memory"


def test_a_server_stops_when_the_process_that_started_it_is_killed(tiny_path, tmp_path):
    pid_file = tmp_path / "server.pid"
    starter = subprocess.Popen([sys.executable, "-c", (
        "import os, time\nfrom lightning_vlm.serving.process import start_server\n"
        f"proc, _ = start_server({tiny_path('qwen2_5_vl')!r}, log_path={str(tmp_path / 'log')!r})\n"
        f"open({str(pid_file)!r} + '.tmp', 'w').write(str(proc.pid))\n"
        f"os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\ntime.sleep(600)\n"
    )])  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        server = psutil.Process(int(pid_file.read_text()))
        # Past its first lines (it asked for the signal) once it holds torch (hundreds of MB): so the
        # kernel's signal is what stops it, not its own check that its starter is gone.
        while server.memory_info().rss < 300e6 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(server), "the server exited while starting"
    finally:
        starter.kill()  # a trainer killed (SIGKILL, out of memory): nothing of ours runs in it any more
        starter.wait()
    # Its own session: no SIGHUP; the kernel's SIGTERM stops it. Not its parent any more, so a stopped
    # server may linger as a zombie until whoever adopted it reaps it: that counts as stopped.
    deadline = time.monotonic() + 120
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _running(server):
        os.killpg(server.pid, signal.SIGKILL)
        pytest.fail("the server outlived the process that started it")


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_server_whose_starter_died_before_it_asked_stops_at_once():
    # Its starter is not its parent any more (it died and the server was handed to another): no signal
    # would ever come, so the server stops itself.
    code = "from lightning_vlm.serving.process import stop_with_parent\nstop_with_parent()\nimport time; time.sleep(60)"
    env = {**os.environ, STOP_WITH_PID: str(os.getpid() + 1_000_000)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == -signal.SIGTERM
    env.pop(STOP_WITH_PID)  # started by hand: it runs until stopped
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], env=env, timeout=5)
