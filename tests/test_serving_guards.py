"""The server plugin's middleware and launcher rules, on a bare ASGI app (no engine): the API key on
every route but the probes, and body limits per route, checked before a body is read."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from lightning_vlm.serving.guards import WEIGHTS_PATH, BodyLimit, KeyOnEveryRoute, is_octet_stream


async def _echo(request):
    return JSONResponse({"bytes": len(await request.body())})


async def _socket(websocket):
    await websocket.accept()
    await websocket.send_text("hi")
    await websocket.close()


def _client(tokens: list[str] | None = None, max_bytes: int = 100, max_weights: int = 1000) -> TestClient:
    routes = [
        Route(p, _echo, methods=["GET", "POST"])
        for p in ("/health", "/v1/x", "/collective_rpc", WEIGHTS_PATH)
    ]
    app = Starlette(routes=[*routes, WebSocketRoute("/ws", _socket)])
    app.add_middleware(BodyLimit, max_bytes=max_bytes, max_weights_bytes=max_weights)
    if tokens:
        app.add_middleware(KeyOnEveryRoute, tokens=tokens)
    return TestClient(app)


def test_the_key_is_required_on_every_route_but_the_probes():
    client = _client(tokens=["k1", "k2"])
    for path in ("/v1/x", "/collective_rpc", WEIGHTS_PATH, "/V1/x", "/collective_rpc/"):
        response = client.post(path, content=b"{}")
        assert response.status_code == 401 and "Authorization: Bearer" in response.json()["error"], path
    assert client.get("/health").status_code == 200
    assert client.post("/v1/x", content=b"{}", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert client.post("/v1/x", content=b"{}", headers={"Authorization": "Basic k2"}).status_code == 401
    assert client.post("/v1/x", content=b"{}", headers={"Authorization": "Bearer k3"}).status_code == 401
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws"):
        pass
    assert refused.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer k1"}) as ws:
        assert ws.receive_text() == "hi"


def test_bodies_are_limited_per_route_before_they_are_read():
    client = _client(max_bytes=100, max_weights=1000)
    assert client.post("/v1/x", content=b"x" * 100).json() == {"bytes": 100}
    too_big = client.post("/v1/x", content=b"x" * 101)
    assert too_big.status_code == 413 and "--max-request-mb" in too_big.json()["error"]
    assert "data.image_max_pixels" in too_big.json()["error"]
    octet = {"Content-Type": "Application/Octet-Stream; charset=binary"}
    assert client.post(WEIGHTS_PATH, content=b"x" * 1000, headers=octet).json() == {"bytes": 1000}
    assert client.post(WEIGHTS_PATH, content=b"x" * 1001, headers=octet).status_code == 413
    # A JSON body to the weights route gets the small limit: only the raw upload is streamed.
    assert client.post(WEIGHTS_PATH, content=b"x" * 101).status_code == 413
    assert (
        "image_max_pixels" not in client.post(WEIGHTS_PATH, content=b"x" * 101).json()["error"]
    )  # no images
    chunked = client.post("/v1/x", content=iter([b"x", b"y"]))  # no Content-Length: chunked
    assert chunked.status_code == 411
    assert client.post("/v1/x").status_code == 200  # no body at all (e.g. POST /sleep?level=1)
    assert client.post("/v1/x", content=b"x", headers={"Content-Length": "1x"}).status_code == 400
    assert is_octet_stream("application/octet-stream") and not is_octet_stream("application/json")
