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


def test_engine_settings_a_hand_started_server_never_reads_are_warned_about(caplog):
    from hydra.utils import instantiate

    from helpers import compose_train
    from lightning_vlm.callbacks.vllm import VLLMGeneration

    def warned(**kwargs) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightning_vlm.callbacks.vllm"):
            VLLMGeneration(**kwargs)
        return [r.getMessage() for r in caplog.records if "started by hand" in r.getMessage()]

    (message,) = warned(mode="server", engine={"max_model_len": 4096, "mm_processor_cache_gb": 2.0})
    assert "engine.max_model_len, engine.mm_processor_cache_gb" in message
    assert not warned(
        mode="server", start_server=True, engine={"max_model_len": 4096}
    )  # its server takes them
    assert not warned(mode="colocate", engine={"max_model_len": 4096})
    # the configs as shipped: generation=vllm_server's own engine settings are no user's doing
    node = compose_train(["method=grpo", "generation=vllm_server"]).callbacks.vllm_generation
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_vlm.callbacks.vllm"):
        instantiate(node, _convert_="all")
    assert not [r for r in caplog.records if "started by hand" in r.getMessage()]
    node = compose_train(
        ["method=grpo", "generation=vllm_server", "callbacks.vllm_generation.engine.dtype=bfloat16"]
    )
    with caplog.at_level("WARNING", logger="lightning_vlm.callbacks.vllm"):
        instantiate(node.callbacks.vllm_generation, _convert_="all")
    assert any("engine.dtype configure" in r.getMessage() for r in caplog.records)
