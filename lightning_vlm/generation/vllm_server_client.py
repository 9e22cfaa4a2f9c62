"""Talking to ``lightning_vlm.serve``: an HTTP client with timeouts and bounded retries, and a Generator."""

from __future__ import annotations

import base64
import io
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import requests

from lightning_vlm.generation.base import Rollouts, SamplingSettings
from lightning_vlm.generation.vllm_engine import vllm_inputs
from lightning_vlm.generation.vllm_sampling import build_rollouts, request_seeds, sampling_kwargs
from lightning_vlm.generation.weight_sync import policy_weights, weights_to_bytes, write_weights

log = logging.getLogger(__name__)
TRANSFERS = ("folder", "body")


class VLLMServerError(RuntimeError):
    """The server is unreachable, timed out, or answered with an error (the message names the URL)."""


class VLLMServerClient:
    """JSON calls to the server; connection failures and timeouts are retried ``retries`` times."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        retries: int = 2,
        backoff: float = 0.5,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeout and connect_timeout must be > 0, got {timeout}, {connect_timeout}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self.session = requests.Session()

    def request(self, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> dict:
        """One call, retried on connection errors/timeouts; an HTTP error is raised at once."""
        url = f"{self.url}{path}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.session.request(
                    method, url, timeout=(self.connect_timeout, timeout or self.timeout), **kwargs
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                last = exc
                continue
            if response.status_code != 200:
                try:
                    reason = response.json().get("error", response.text)
                except ValueError:
                    reason = response.text
                raise VLLMServerError(f"vLLM server at {url} answered {response.status_code}: {reason}")
            return response.json()
        raise VLLMServerError(
            f"vLLM server at {url} is not reachable ({self.retries + 1} attempts, timeout "
            f"{timeout or self.timeout:g} s): {type(last).__name__}: {last}. Is it running? Start it with "
            f"`python -m lightning_vlm.serve MODEL_DIR --port PORT`."
        ) from last

    def health(self) -> dict:
        """The server's status (fast; answers even while it generates)."""
        return self.request("GET", "/health", timeout=self.connect_timeout)

    def wait_until_ready(self, timeout: float = 180.0, poll: float = 1.0) -> dict:
        """Poll /health until the engine is up (it loads the model before binding); bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = self.session.get(f"{self.url}/health", timeout=self.connect_timeout)
                if response.status_code == 200:
                    return response.json()
            except (requests.ConnectionError, requests.Timeout):
                pass
            if time.monotonic() > deadline:
                raise VLLMServerError(f"vLLM server at {self.url} not ready within {timeout:g} s")
            time.sleep(poll)

    def generate(
        self,
        prompts: list[str],
        images: list[list[str]],
        sampling: dict,
        seeds: list[int | None] | None = None,
    ) -> dict:
        """Completions for templated prompts with base64 images; G = ``sampling["n"]`` per prompt.

        ``seeds``: one vLLM seed per prompt (overrides ``sampling["seed"]``)."""
        body = {"prompts": prompts, "images": images, "sampling": sampling}
        if seeds is not None:
            body["seeds"] = seeds
        return self.request("POST", "/generate", json=body)

    def update_weights_from_path(self, path: str | Path) -> dict:
        """Reload from a folder of safetensors that the server can read (shared filesystem)."""
        return self.request("POST", "/update_weights", json={"path": str(path)})

    def update_weights_from_bytes(self, blob: bytes) -> dict:
        """Reload from a safetensors blob sent in the request body (no shared filesystem needed)."""
        headers = {"Content-Type": "application/octet-stream"}
        return self.request("POST", "/update_weights", data=blob, headers=headers)

    def sleep(self, level: int = 1) -> dict:
        """Free the server's GPU memory (GPU servers started with --enable-sleep-mode)."""
        return self.request("POST", "/sleep", json={"level": level})

    def wake_up(self) -> dict:
        """Undo ``sleep``."""
        return self.request("POST", "/wake_up", json={})

    def close(self) -> None:
        """Close pooled connections (the server keeps running)."""
        self.session.close()


def encode_image(image: Any) -> str:
    """A PIL image as base64 PNG (lossless: vLLM sees the trainer's pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class VLLMServerGenerator:
    """A ``Generator`` that samples on a ``lightning_vlm.serve`` server and pushes weights to it.

    Weights go as a safetensors folder the server reads (``transfer="folder"``, a shared filesystem)
    or in the request body (``transfer="body"``). Same sampling behaviour as ``HFGenerator``.
    """

    is_policy = False

    def __init__(
        self, vlm: Any, client: VLLMServerClient, transfer: str = "folder", sync_dir: str | None = None
    ) -> None:
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.vlm = vlm
        self.client = client
        self.transfer = transfer
        self._tmp = None if sync_dir else tempfile.TemporaryDirectory(prefix="lightning-vlm-sync-")
        self.sync_dir = Path(sync_dir or self._tmp.name)
        self.seed: int | None = None
        self._version = 0  # pushes so far (names the folder of each)

    def set_seed(self, seed: int | None) -> None:
        """Seed the following generations (one vLLM seed per prompt, ``request_seeds``); None: unseeded."""
        self.seed = seed

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """``num_generations`` completions per row (consecutive), cut after the end-of-turn token."""
        vlm = self.vlm
        prompts = [vllm_inputs(vlm.processor, r["prompt"], [])["prompt"] for r in rows]
        images = [[encode_image(im) for im in r.get("images", [])] for r in rows]
        params = sampling_kwargs(sampling, num_generations, vlm.end_of_turn_id, vlm.suppressed_token_ids)
        seeds = request_seeds(self.seed, len(rows), num_generations) if self.seed is not None else None
        out = self.client.generate(prompts, images, params, seeds)
        rollouts = build_rollouts(
            rows, num_generations, out["completion_ids"], out["logprobs"], vlm.end_of_turn_id,
            vlm.tokenizer, "vllm_server",
        )  # fmt: skip
        # How many weight pushes the server had taken when it sampled these (staleness checks).
        rollouts.extras["weight_version"] = out.get("weight_version")
        return rollouts

    def sync_weights(self, chunks: Iterable[dict[str, Any]] | None = None) -> float:
        """Push the policy (LoRA merged) to the server; seconds taken, transfer included.

        ``chunks`` (FSDP units, see ``policy_weights``): with ``transfer="folder"`` each unit is written
        to its own file as it is gathered, so the full model is never in memory at once.
        """
        start = time.perf_counter()
        if self.transfer == "body":
            self.client.update_weights_from_bytes(weights_to_bytes(policy_weights(self.vlm, chunks)))
            return time.perf_counter() - start
        # A fresh folder per push: the server reads every *.safetensors of it, none from the last push.
        self._version += 1
        folder = self.sync_dir / f"v{self._version}"
        parts = (
            [policy_weights(self.vlm)] if chunks is None else (policy_weights(self.vlm, [c]) for c in chunks)
        )
        for i, weights in enumerate(parts):
            write_weights(weights, folder, name=f"model-{i:05d}.safetensors")
        self.client.update_weights_from_path(folder)
        shutil.rmtree(self.sync_dir / f"v{self._version - 1}", ignore_errors=True)
        return time.perf_counter() - start

    def sleep(self) -> None:
        """No-op: a server on its own device needs no room for the trainer's backward."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """Close the client; the server is not ours to stop."""
        self.client.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(
    model: str, port: int | None = None, host: str = "127.0.0.1", args: list[str] | None = None,
    log_path: str | None = None,
) -> tuple[Any, str]:  # fmt: skip
    """Start ``python -m lightning_vlm.serve`` in a subprocess; returns (process, url). Not waited for."""
    import os
    import subprocess
    import sys

    port = port or free_port(host)
    cmd = [sys.executable, "-m", "lightning_vlm.serve", str(model), "--host", host, "--port", str(port)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives with the process)
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    proc = subprocess.Popen([*cmd, *(args or [])], stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://{host}:{port}"


def stop_server(proc: Any, timeout: float = 30.0) -> int:
    """SIGTERM the server process (it shuts down cleanly), SIGKILL after ``timeout``; its exit code."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout)
