"""A vLLM server the tests share, and the faults they inject into it (tests/test_vllm_server.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import psutil
import requests

from lightning_vlm.generation.vllm_server_client import VLLMServerClient, VLLMServerError
from lightning_vlm.serving.process import free_port, start_server, stop_server

KEY = "test-key"
MAX_REQUEST_MB = 8


@dataclass
class Served:
    """Our launcher's server on a free loopback port, with an API key and a small body limit."""

    model: str
    log: Path
    port: int = field(default_factory=free_port)
    proc: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc, _ = start_server(self.model, port=self.port, log_path=str(self.log),
                                    args=["--api-key", KEY, "--max-request-mb", str(MAX_REQUEST_MB)])  # fmt: skip

    def wait(self, timeout: float = 300) -> None:
        try:
            VLLMServerClient(self.url).wait_until_ready(timeout)
        except VLLMServerError as exc:
            raise AssertionError(f"server did not start:\n{self.log.read_text()[-4000:]}") from exc

    def client(self, **kwargs) -> VLLMServerClient:
        return VLLMServerClient(self.url, api_key=KEY, **kwargs)

    def stop(self) -> None:
        stop_server(self.proc)


def engine_core(proc) -> psutil.Process:
    """vLLM's engine-core child of a server process."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError(f"no EngineCore process under {proc.pid}")


class CrashEngineAndRestart(L.Callback):
    """At ``step`` (after VLLMGeneration pushed that step's weights), SIGKILLs the engine core of the
    server that callback started, records what ``/health`` answers until vLLM's server exits, then
    starts the same server again on the same port (the training run retries until it is up)."""

    def __init__(self, vllm_callback, step: int) -> None:
        self.vllm, self.step = vllm_callback, step
        self.health: list[int] = []
        self.generator = None
        self.proc = None  # the restarted server: the test stops it

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self.generator is not None:
            return
        self.generator = pl_module.generator
        proc, url = self.vllm._server_process, self.vllm.server["url"]
        engine_core(proc).kill()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                self.health.append(requests.get(f"{url}/health", timeout=2).status_code)
            except requests.RequestException:
                pass
            # vLLM's server exits soon after it notices the dead engine: on a quiet machine the 503 window
            # was under 0.2 s (a CI run saw only [200]), so poll often enough to see it.
            time.sleep(0.01)
        stop_server(proc)  # reap what is left of its process group
        # Started here, not waited for: the run's next requests find nobody listening until it is up.
        # (From this thread: the server dies with the thread that started it, PR_SET_PDEATHSIG.)
        model, port = pl_module.vlm.model_name_or_path, int(url.rsplit(":", 1)[1])
        self.proc, _ = start_server(
            model, port=port, args=self.vllm._server_cli_args(), env=self.vllm.server_env()
        )
