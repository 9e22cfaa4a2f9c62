"""ASGI middleware the server adds around vLLM's app: every route authenticated, bodies bounded.

vLLM's ``--api-key`` guards only ``/v1``-style paths; its dev and RL routes (``/collective_rpc``,
``/update_weights``, ``/sleep``, ...) stay open, and they can change or stop the model. With a key
set, :class:`KeyOnEveryRoute` requires it on every route but the liveness probes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
App = Callable[[Scope, Callable, Callable], Awaitable[None]]
# Probes a load balancer or a waiting trainer calls without credentials; they reveal nothing.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
WEIGHTS_PATH = "/lightning_vlm/reload_weights"


async def _send_json(scope: Scope, send: Callable, status: int, payload: dict) -> None:
    if scope["type"] == "websocket":  # refused before the handshake: close it with a policy code
        await send({"type": "websocket.close", "code": 1008, "reason": payload.get("error", "")[:120]})
        return
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def is_octet_stream(content_type: str | None) -> bool:
    """Whether a Content-Type names a raw body (the weight upload), however it is spelt."""
    return (content_type or "").split(";")[0].strip().lower() == "application/octet-stream"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class KeyOnEveryRoute:
    """Refuses (401) any request but ``OPEN_PATHS`` without ``Authorization: Bearer <one of tokens>``."""

    def __init__(self, app: App, tokens: list[str]) -> None:
        self.app = app
        self.hashes = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def _authorised(self, scope: Scope) -> bool:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        # compare_digest on every key: the time taken does not tell which prefix matched.
        return any([secrets.compare_digest(digest, h) for h in self.hashes])

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in OPEN_PATHS and not self._authorised(scope):
                return await _send_json(
                    scope, send, 401, {"error": f"{path} needs 'Authorization: Bearer <api key>'"}
                )
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 before reading a body larger than its route allows (411 for a chunked body of
    unknown length); the raw weight upload, streamed to disk, has its own larger limit."""

    def __init__(self, app: App, max_bytes: int, max_weights_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_weights_bytes = max_weights_bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        upload = path == WEIGHTS_PATH and is_octet_stream(_header(scope, b"content-type"))
        # The upload streams to disk (and counts what it reads); everything else is read whole.
        limit, flag = (
            (self.max_weights_bytes, "--max-weights-gb") if upload else (self.max_bytes, "--max-request-mb")
        )
        length = _header(scope, b"content-length")
        if length is None:
            if _header(scope, b"transfer-encoding") and not upload:
                return await _send_json(scope, send, 411, {"error": "request bodies need a Content-Length"})
            return await self.app(scope, receive, send)  # no body, or the counted upload
        if not length.strip().isdigit():
            return await _send_json(scope, send, 400, {"error": f"bad Content-Length {length!r}"})
        if int(length) > limit:
            # A generation request (OpenAI's /v1 routes) is mostly its images, sent as PNGs at the size the
            # trainer holds them.
            hint = (
                "; or scale the trainer's images down: data.image_max_pixels"
                if path.startswith("/v1/")
                else ""
            )
            return await _send_json(
                scope, send, 413, {"error": f"body of {length} B exceeds {limit} B ({flag}{hint})"}
            )
        await self.app(scope, receive, send)
