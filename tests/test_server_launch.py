"""Starting the server the callback owns (``serving.process.launch_server``), for real: a server that
dies while loading fails at once with its log's tail, and a port taken between picking it and vLLM
binding it is retried on another port."""

from __future__ import annotations

import socket

import pytest

from lightning_vlm.generation.vllm_server_client import VLLMServerClient
from lightning_vlm.serving import process
from lightning_vlm.serving.process import ServerStartError, launch_server, log_tail, stop_server

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
