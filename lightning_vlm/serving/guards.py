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


async def _send_json(send: Callable, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
                    send, 401, {"error": f"{path} needs 'Authorization: Bearer <api key>'"}
                )
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 before reading a body larger than its route allows (411 for a JSON body of
    unknown length); the weight upload, streamed to disk, has its own larger limit."""

    def __init__(self, app: App, max_bytes: int, max_weights_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_weights_bytes = max_weights_bytes

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        weights = scope["path"].removeprefix(scope.get("root_path", "")) == WEIGHTS_PATH
        limit = self.max_weights_bytes if weights else self.max_bytes
        length = _header(scope, b"content-length")
        if length is None and not weights:
            return await _send_json(send, 411, {"error": "request bodies need a Content-Length"})
        if length is not None and int(length) > limit:
            flag = "--max-weights-gb" if weights else "--max-request-mb"
            return await _send_json(send, 413, {"error": f"body of {length} B exceeds {limit} B ({flag})"})
        await self.app(scope, receive, send)
