"""The vLLM server settings the callback refuses before it polls anything: a URL no request could reach,
options that would move the server it starts; and a server that is not up, named in the error."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("127.0.0.1:8000", "must start with http:// or https://"),  # every poll failed as "not up yet"
        ("localhost:8000", "must start with http"),
        ("http://127.0.0.1:8000/v1", "not its OpenAI API path.*'http://127.0.0.1:8000'"),  # /v1/health: 404
        ("http://127.0.0.1:8000/v1/", "not its OpenAI API path"),
    ],
)
def test_a_server_url_that_no_request_could_reach_is_refused_naming_the_setting(url, message):
    from lightning_vlm.generation.vllm_server_client import VLLMServerClient

    with pytest.raises(ValueError, match=f"callbacks.vllm_generation.server_url.*{message}"):
        VLLMServerClient(url)
    assert VLLMServerClient("https://host:8000/").url == "https://host:8000"


def test_a_server_that_is_not_up_is_polled_and_named():
    import socket

    from lightning_vlm.generation.vllm_server_client import VLLMServerClient, VLLMServerError

    with socket.socket() as s:  # a port nothing listens on: connection refused, "not up yet"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = VLLMServerClient(f"http://127.0.0.1:{port}", connect_timeout=0.5)
    assert client.health() is False
    with pytest.raises(VLLMServerError, match="not ready within 0.2 s.*wait_for_server"):
        client.wait_until_ready(timeout=0.2, poll=0.1)


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "9000"], ["--host=0.0.0.0"], ["--api-key", "k"], ["--uds", "/tmp/s"],
        ["--api_key", "k"], ["--por", "9000"],  # as vLLM's parser reads them: underscores, prefixes
    ],
)  # fmt: skip
def test_server_args_cannot_move_the_server_the_callback_polls(args):
    from lightning_vlm.callbacks.vllm import VLLMGeneration

    with pytest.raises(ValueError, match=r"server_args cannot set \['--"):
        VLLMGeneration(mode="server", start_server=True, server_args=["--max-model-len", "512", *args])
    VLLMGeneration(mode="server", start_server=True, server_args=["--max-model-len", "512"])  # others pass
    with pytest.raises(ValueError, match=r"are options of the server this callback starts"):
        VLLMGeneration(mode="server", server_args=args)  # a server started by hand: never read
