"""An HTTP client for vLLM's OpenAI-compatible server: timeouts, retries sized for a restart, and
errors that say whether the server timed out or could not be reached.

Works against ``python -m lightning_vlm.serve`` (vLLM's server with our plugin: checked weight
updates, ``/lightning_vlm/*``) and against a plain ``vllm serve`` started with
``VLLM_SERVER_DEV_MODE=1`` (weights then go through vLLM's dev ``/collective_rpc``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import requests

log = logging.getLogger(__name__)


class VLLMServerError(RuntimeError):
    """The server is unreachable, timed out, or answered with an error (the message names the URL)."""


class VLLMServerClient:
    """JSON calls to a vLLM server.

    A connection that cannot be made (refused, reset, connect timeout) is retried with backoff for
    up to ``reconnect_timeout`` seconds, long enough for a server to restart and load its model;
    every retry is logged. A request that timed out after ``timeout`` seconds (the server is up but
    slow or stuck) is retried ``retries`` times. HTTP errors are raised at once, with the server's reason.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        retries: int = 1,
        reconnect_timeout: float = 300.0,
        backoff: float = 1.0,
        api_key: str | None = None,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0 or reconnect_timeout < 0 or backoff <= 0:
            raise ValueError(
                "timeout, connect_timeout and backoff must be > 0 and reconnect_timeout >= 0, got "
                f"{timeout}, {connect_timeout}, {backoff}, {reconnect_timeout}"
            )
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = _server_root(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.reconnect_timeout = reconnect_timeout
        self.backoff = backoff
        self.session = requests.Session()
        api_key = api_key if api_key is not None else os.environ.get("VLLM_API_KEY")
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.reconnects = 0  # times a lost connection came back (the server may have restarted)
        self._model: str | None = None

    def request(self, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """One call with the retry policy above; the JSON answer (None for an empty body)."""
        url = f"{self.url}{path}"
        timeout = timeout or self.timeout
        first_failure: float | None = None
        timeouts = attempt = 0
        while True:
            attempt += 1
            try:
                response = self.session.request(
                    method, url, timeout=(self.connect_timeout, timeout), **kwargs
                )
            except requests.ConnectionError as exc:  # refused, reset or connect timeout
                first_failure = first_failure or time.monotonic()
                self._wait_to_reconnect(url, _reason(exc), attempt, first_failure, exc)
                continue
            except requests.Timeout as exc:
                timeouts += 1
                if timeouts > self.retries:
                    raise self._timed_out(url, timeout, attempt) from exc
                log.warning("vLLM server at %s timed out after %g s; retry %d of %d", url, timeout, timeouts,
                            self.retries)  # fmt: skip
                continue
            if _engine_died(response):
                # vLLM answers the requests in flight so, then shuts the server down (terminate_if_errored):
                # the same as a lost connection, which a supervisor's restart brings back.
                first_failure = first_failure or time.monotonic()
                self._wait_to_reconnect(url, "its engine died", attempt, first_failure, None)
                continue
            if first_failure is not None:
                self.reconnects += 1
                log.warning("vLLM server at %s reachable again after %d attempts (%.1f s)", url, attempt,
                            time.monotonic() - first_failure)  # fmt: skip
            return self._answer(url, response)

    def _wait_to_reconnect(
        self, url: str, reason: str, attempt: int, first_failure: float, exc: Exception | None
    ) -> None:
        """Sleeps before the next attempt (backoff), or raises once ``reconnect_timeout`` is spent."""
        waited = time.monotonic() - first_failure
        if waited >= self.reconnect_timeout:
            raise self._unreachable(url, reason, attempt, waited) from exc
        delay = min(self.backoff * 2 ** min(attempt - 1, 4), 10.0, self.reconnect_timeout - waited)
        log.warning("vLLM server at %s unreachable (%s); retry %d in %.1f s (%.0f of %g s reconnect budget "
                    "used)", url, reason, attempt, delay, waited, self.reconnect_timeout)  # fmt: skip
        time.sleep(max(delay, 0.0))

    @staticmethod
    def _answer(url: str, response: requests.Response) -> Any:
        if response.status_code >= 400:
            try:
                payload = response.json()
                reason = payload.get("error", payload.get("detail", payload))
                reason = reason.get("message", reason) if isinstance(reason, dict) else reason
            except ValueError:
                reason = response.text
            raise VLLMServerError(f"vLLM server at {url} answered {response.status_code}: {reason}")
        return response.json() if response.content else None

    def _timed_out(self, url: str, timeout: float, attempts: int) -> VLLMServerError:
        return VLLMServerError(
            f"vLLM server at {url} timed out: no answer within {timeout:g} s ({attempts} attempts). It is "
            f"reachable but slow or stuck; raise server_timeout if generations are this long."
        )

    def _unreachable(self, url: str, reason: str, attempts: int, waited: float) -> VLLMServerError:
        return VLLMServerError(
            f"vLLM server at {url} is not reachable ({reason}; {attempts} attempts over {waited:.0f} s, "
            f"reconnect budget {self.reconnect_timeout:g} s). Is it running? Start it with "
            f"`python -m lightning_vlm.serve MODEL_DIR --port PORT`."
        )

    def health(self) -> bool:
        """Whether the server answers ``/health`` with 200 right now (no retries, ``connect_timeout``)."""
        try:
            return self.session.get(f"{self.url}/health", timeout=self.connect_timeout).status_code == 200
        # Not up yet (refused, timed out, dropped mid-answer while starting); any other error no wait fixes
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError):
            return False

    def wait_until_ready(self, timeout: float = 180.0, poll: float = 1.0) -> None:
        """Poll ``/health`` until the engine is up (connections are refused while it loads); bounded by ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"vLLM server at {self.url} not ready within {timeout:g} s: /health never answered 200. "
                    "Is it still loading (callbacks.vllm_generation.wait_for_server sets the wait), or is "
                    "another server on that port?"
                )
            time.sleep(poll)

    def model(self) -> str:
        """The served model's name (``/v1/models``), as chat requests must give it."""
        if self._model is None:
            self._model = self.request("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def plugin_info(self) -> dict | None:
        """``/lightning_vlm/info`` of a server with our plugin; None for a plain vLLM server."""
        try:
            return self.request("GET", "/lightning_vlm/info")
        except VLLMServerError as exc:
            if " answered 404" in str(exc):
                return None
            raise

    def weight_version(self) -> str | None:
        """vLLM's weight version label (``/weight_info``, dev mode); None where the server has none."""
        try:
            return self.request("GET", "/weight_info")["weight_version"]
        except VLLMServerError as exc:
            if " answered 404" in str(exc):
                return None
            raise

    def chat(self, body: dict) -> dict:
        """``POST /v1/chat/completions`` (the model name filled in)."""
        return self.request("POST", "/v1/chat/completions", json={"model": self.model(), **body})

    def reload_weights(self, path: str | None = None, blob: bytes | None = None, version: str = "") -> dict:
        """Load new weights: a folder the server reads, or a safetensors ``blob`` (our plugin only)."""
        if blob is not None:
            headers = {"Content-Type": "application/octet-stream"}
            return self.request("POST", "/lightning_vlm/reload_weights", data=blob, headers=headers,
                                params={"weight_version": version})  # fmt: skip
        return self.request(
            "POST", "/lightning_vlm/reload_weights", json={"path": path, "weight_version": version}
        )

    def reload_weights_dev_mode(self, path: str, version: str) -> None:
        """The same through a plain vLLM server's dev endpoints (unchecked: a bad folder kills its engine)."""
        self.request(
            "POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}}
        )
        self.request("POST", "/reset_prefix_cache")
        self.request("POST", "/reset_encoder_cache")
        self.request("POST", "/update_weight_version", json={"new_version": version})

    def sleep(self, level: int = 1) -> None:
        """Free the server's GPU memory (dev mode, ``--enable-sleep-mode``)."""
        self.request("POST", "/sleep", params={"level": level})

    def wake_up(self) -> None:
        """Undo ``sleep``."""
        self.request("POST", "/wake_up")

    def close(self) -> None:
        """Close pooled connections (the server keeps running)."""
        self.session.close()


def _reason(exc: Exception) -> str:
    text = str(exc)
    for known in ("Connection refused", "Connection reset", "Remote end closed", "Max retries exceeded"):
        if known in text:
            return known.lower() if known != "Max retries exceeded" else "no connection"
    return type(exc).__name__


# vLLM's EngineDeadError (vllm/v1/engine/exceptions.py), as its server answers the requests in flight.
ENGINE_DEAD = "EngineCore encountered an issue"


def _engine_died(response: requests.Response) -> bool:
    """Whether an error answer says the server's engine died (not that the request was bad)."""
    return response.status_code >= 500 and ENGINE_DEAD in response.text


def _server_root(url: str) -> str:
    """The server's root URL, checked: ``http(s)://host:port``, which requests' paths (``/health``,
    ``/v1/...``) follow. Without a scheme every request failed as "not up yet" until the wait ran out."""
    root = url.rstrip("/")
    if not root.startswith(("http://", "https://")):
        raise ValueError(
            f"callbacks.vllm_generation.server_url must start with http:// or https://, got {url!r} "
            f"(e.g. http://{root or '127.0.0.1:8000'})"
        )
    if root.endswith("/v1"):
        raise ValueError(
            f"callbacks.vllm_generation.server_url is the server's root, not its OpenAI API path: got {url!r}, "
            f"use {root[: -len('/v1')]!r}"
        )
    return root
