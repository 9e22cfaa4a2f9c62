"""The vLLM endpoint plugin: checked weight updates, a health check that knows about them, guards.

Registered as the ``vllm.endpoint_plugins`` entry point ``lightning_vlm`` (pyproject.toml) and loaded
by vLLM's own ``build_app`` when ``VLLM_PLUGINS`` names it: ``lightning_vlm.serve`` sets that, and a
``vllm serve`` deployment can too. Settings come from the environment (``LIGHTNING_VLM_*``), since
``vllm serve``'s own parser knows nothing of ours.

``POST /lightning_vlm/reload_weights`` takes ``{"path": folder, "weight_version": str}`` (a shared
filesystem) or a safetensors body (``application/octet-stream``, ``?weight_version=``) streamed to
disk. The update is checked against the served checkpoint first (``weights_check``); then generation
is paused, vLLM's ``reload_weights`` runs, caches are reset and vLLM's weight version is set. If
the engine still fails, the checkpoint's own weights are reloaded (version ``base``: a client sees
it lost its weights and pushes again); if even that fails, ``/health`` answers 503 from then on.
"""
# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at runtime.

import asyncio
import logging
import os
import shutil
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from lightning_vlm.serving.guards import WEIGHTS_PATH, BodyLimit, KeyOnEveryRoute, is_octet_stream
from lightning_vlm.serving.weights_check import UpdateRefused, check_update, read_shapes, reference_shapes

log = logging.getLogger("lightning_vlm.serving")
BASE_VERSION = "base"
DEFAULT_MAX_REQUEST_MB = 64.0  # JSON bodies: prompts and images as data URLs
DEFAULT_MAX_WEIGHTS_GB = 64.0  # streamed to disk, never held in memory


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return default if raw in (None, "") else float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc


def served_folder(model: str) -> Path | None:
    """The local folder of the served checkpoint (a path, or the hub cache's copy); None if unknown."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        return None


class WeightUpdates:
    """One update at a time, checked against the served checkpoint, with recovery on failure."""

    def __init__(self, engine: Any, model: str) -> None:
        self.engine = engine
        self.base = served_folder(model)
        self.reference = reference_shapes(self.base) if self.base else None
        if self.reference is None:
            log.warning("checkpoint of %r not found locally: weight updates are not checked", model)
        self.lock = asyncio.Lock()
        self.wedged: str | None = None  # why the engine cannot serve any more
        self.scratch = tempfile.TemporaryDirectory(prefix="lightning-vlm-upload-")

    async def reload(self, folder: Path, version: str) -> dict:
        """Check ``folder``, then load it into the engine; the answer or ``UpdateRefused``."""
        update = read_shapes(folder)
        if self.reference is not None:
            check_update(update, self.reference)
        async with self.lock:
            start = time.perf_counter()
            # "wait": requests in flight finish on the old weights; none starts on half-loaded ones.
            await self.engine.pause_generation(mode="wait")
            try:
                await self._load(folder, version)
            except Exception as exc:
                log.exception("weight update from %s failed after its check", folder)
                await self._recover(exc)
                raise RuntimeError(
                    f"the engine failed to load {folder} ({type(exc).__name__}: {exc}); it serves the "
                    f"checkpoint's own weights again (weight_version {BASE_VERSION!r}): push again"
                ) from exc
            finally:
                # Resumed even when wedged: requests then fail at once instead of hanging paused.
                await self.engine.resume_generation()
        seconds = time.perf_counter() - start
        log.info("weights %s loaded from %s in %.2f s (%d tensors)", version, folder, seconds, len(update))
        return {"weight_version": version, "seconds": seconds, "tensors": len(update)}

    async def _load(self, folder: Path, version: str) -> None:
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": os.fspath(folder)})
        # KV blocks and image embeddings computed with the old weights must not be reused.
        await self.engine.reset_prefix_cache()
        await self.engine.reset_encoder_cache()
        await self.engine.update_weight_version(version)

    async def _recover(self, cause: Exception) -> None:
        try:
            if self.base is None:
                raise RuntimeError("no local checkpoint to fall back to")
            await self._load(self.base, BASE_VERSION)
        except Exception as exc:
            self.wedged = f"a weight update failed ({cause}) and reloading the checkpoint failed ({exc})"
            log.error("engine unusable: %s", self.wedged)

    async def save_upload(self, request: Any, limit: int) -> Path:
        """Stream a request body to a fresh scratch folder as one safetensors file (removed on failure)."""
        from starlette.requests import ClientDisconnect

        folder = Path(tempfile.mkdtemp(dir=self.scratch.name))
        size = 0
        try:
            with open(folder / "model.safetensors", "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise UpdateRefused(f"weights body exceeds {limit} B (--max-weights-gb)")
                    # Off the event loop: a multi-GB write must not stall every other request.
                    await asyncio.to_thread(f.write, chunk)
        except ClientDisconnect as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise UpdateRefused(f"the client disconnected after {size} B of the weights body") from exc
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder


class LightningVLMPlugin:
    """vLLM ``EndpointPlugin``: lightning-vlm's routes and middleware on vLLM's own app."""

    name = "lightning_vlm"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        """Our routes (``/health`` replaces vLLM's) and middleware, added inside vLLM's ``build_app``."""
        from vllm import envs

        args: Namespace = app.state.args
        max_bytes = int(_env_float("LIGHTNING_VLM_MAX_REQUEST_MB", DEFAULT_MAX_REQUEST_MB) * 2**20)
        max_weights = int(_env_float("LIGHTNING_VLM_MAX_WEIGHTS_GB", DEFAULT_MAX_WEIGHTS_GB) * 2**30)
        tokens = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
        if tokens:
            app.add_middleware(KeyOnEveryRoute, tokens=tokens)
        app.add_middleware(BodyLimit, max_bytes=max_bytes, max_weights_bytes=max_weights)
        router = APIRouter()

        def updates(request: Request) -> WeightUpdates:
            return request.app.state.lightning_vlm_updates

        @router.get("/health")
        async def health(request: Request) -> JSONResponse:
            from vllm.v1.engine.exceptions import EngineDeadError

            if updates(request).wedged:
                return JSONResponse({"status": "unhealthy", "error": updates(request).wedged}, 503)
            try:
                await request.app.state.engine_client.check_health()
            except EngineDeadError as exc:
                return JSONResponse({"status": "unhealthy", "error": str(exc)}, 503)
            return JSONResponse({"status": "ok"})

        @router.get("/lightning_vlm/info")
        async def info(request: Request) -> JSONResponse:
            version = await request.app.state.engine_client.get_weight_version()
            return JSONResponse({"plugin": self.name, "model": args.model, "weight_version": version,
                                 "max_request_bytes": max_bytes, "max_weights_bytes": max_weights})  # fmt: skip

        @router.post(WEIGHTS_PATH)
        async def reload_weights(request: Request) -> JSONResponse:
            guard = updates(request)
            upload = None
            try:
                if is_octet_stream(request.headers.get("content-type")):
                    folder = upload = await guard.save_upload(request, max_weights)
                    version = request.query_params.get("weight_version")
                else:
                    body = await _json_object(request)
                    if not isinstance(body.get("path"), str) or not Path(body["path"]).is_dir():
                        raise UpdateRefused(
                            f"'path' must name a folder the server can read, got {body.get('path')!r}"
                        )
                    folder, version = Path(body["path"]), body.get("weight_version")
                if not isinstance(version, str) or not version:
                    raise UpdateRefused("'weight_version' (a non-empty string) is required")
                return JSONResponse(await guard.reload(folder, version))
            except UpdateRefused as exc:
                return JSONResponse({"error": str(exc)}, 400)
            except RuntimeError as exc:
                return JSONResponse({"error": str(exc)}, 500)
            finally:
                if upload is not None:  # loaded or refused: recovery uses the checkpoint, not uploads
                    shutil.rmtree(upload, ignore_errors=True)

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """The update guard, bound to the engine and the served checkpoint."""
        state.lightning_vlm_updates = WeightUpdates(engine_client, args.model)


async def _json_object(request: Any) -> dict:
    import json

    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        raise UpdateRefused(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UpdateRefused("body must be a JSON object")
    return body
