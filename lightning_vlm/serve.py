"""A vLLM generation server with a weight-update endpoint (TRL's ``vllm_mode="server"``).

    python -m lightning_vlm.serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--max-model-len 1024] ...

Endpoints (JSON): ``GET /health``; ``POST /generate`` {prompts: [templated text] | messages: [[...]],
images: [[base64 PNG]], sampling: {SamplingParams kwargs}, seeds: [one per prompt, optional]} -> {completion_ids, logprobs,
finish_reasons}; ``POST /update_weights`` {path: folder of safetensors} or a raw safetensors body
(``application/octet-stream``) -> {seconds, weight_version}; ``POST /sleep``, ``POST /wake_up``
(GPU). GPU fast path, UNTESTED here (no GPU, no NCCL on CPU): ``POST /init_weight_transfer``
{init_info} and ``POST /update_weights_nccl`` {update_info} forward to vLLM's RL weight-transfer
API (``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, engine started with ``--weight-transfer nccl``); the trainer joins with
``vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine``.

The standard library's threaded HTTP server is enough: vLLM's offline engine is synchronous, so
engine calls are serialised by a lock while /health keeps answering.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import signal
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("lightning_vlm.serve")
# SamplingParams fields a client may set; anything else is refused (never forwarded blindly).
SAMPLING_FIELDS = frozenset({
    "n", "max_tokens", "ignore_eos", "stop_token_ids", "logit_bias", "repetition_penalty", "logprobs",
    "skip_special_tokens", "seed", "temperature", "top_p", "top_k", "min_p",
})  # fmt: skip


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 (413 for an oversized body) and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode_image(data: str, max_pixels: int) -> Any:
    """A base64 PNG/JPEG -> RGB PIL image, downscaled (aspect kept) to at most ``max_pixels`` pixels."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        image.load()
    except Exception as exc:  # malformed base64 or image bytes are the client's fault
        raise BadRequest(f"could not decode an image: {exc}") from exc
    if image.width * image.height > max_pixels:
        # Huge images make the vision encoder take minutes (a hang, as seen by the client): shrink.
        scale = (max_pixels / (image.width * image.height)) ** 0.5
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        log.warning("image %sx%s downscaled to %sx%s (--max-image-pixels)", *image.size, *size)
        image = image.resize(size)
    from lightning_vlm.data.images import to_rgb  # not image.convert: it blackens alpha, clips 16 bits

    return to_rgb(image)


class Engine:
    """The vLLM engine, its processor (chat template) and a lock serialising every engine call."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoProcessor

        from lightning_vlm.generation.vllm_engine import make_vllm_engine

        extra = {"weight_transfer_config": {"backend": args.weight_transfer}} if args.weight_transfer else {}
        self.llm = make_vllm_engine(
            args.model, dtype=args.dtype, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size, enable_sleep_mode=args.enable_sleep_mode,
            model_impl=args.model_impl, limit_mm_per_prompt={"image": args.max_images, "video": 0},
            seed=args.seed, logprobs_mode=args.logprobs_mode, **extra,
        )  # fmt: skip
        self.processor = AutoProcessor.from_pretrained(args.model)
        self.args = args
        self.lock = threading.Lock()
        self.weight_version = 0
        self.scratch = tempfile.TemporaryDirectory(prefix="lightning-vlm-serve-")

    def generate(self, body: dict) -> dict:
        """Sample completions; G = sampling.n consecutive per prompt."""
        from vllm import SamplingParams

        from lightning_vlm.generation.vllm_engine import vllm_inputs
        from lightning_vlm.generation.vllm_sampling import completions_of

        sampling = dict(body.get("sampling") or {})
        unknown = set(sampling) - SAMPLING_FIELDS
        if unknown:
            raise BadRequest(
                f"unsupported sampling fields {sorted(unknown)}; allowed: {sorted(SAMPLING_FIELDS)}"
            )
        if sampling.get("logit_bias"):
            sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"].items()}
        images = body.get("images") or []
        if "prompts" in body:
            texts = list(body["prompts"])
        elif "messages" in body:
            texts = [vllm_inputs(self.processor, m, [])["prompt"] for m in body["messages"]]
        else:
            raise BadRequest("body needs 'prompts' (templated text) or 'messages'")
        if images and len(images) != len(texts):
            raise BadRequest(f"{len(images)} image lists for {len(texts)} prompts")
        requests = []
        for i, text in enumerate(texts):
            pil = [decode_image(x, self.args.max_image_pixels) for x in (images[i] if images else [])]
            requests.append({"prompt": text, "multi_modal_data": {"image": pil}} if pil else {"prompt": text})
        seeds = body.get("seeds")
        if seeds is not None and (
            not isinstance(seeds, list) or len(seeds) != len(texts)
            or not all(s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in seeds)
        ):  # fmt: skip
            raise BadRequest(f"'seeds' must be a list of {len(texts)} integers or nulls, one per prompt")
        try:
            params = (
                SamplingParams(**sampling)
                if seeds is None
                else [SamplingParams(**{**sampling, "seed": seed}) for seed in seeds]
            )
        except Exception as exc:
            raise BadRequest(f"bad sampling parameters: {exc}") from exc
        with self.lock:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        ids, logprobs = completions_of(outputs)
        reasons = [c.finish_reason for request in outputs for c in request.outputs]
        return {"completion_ids": ids, "logprobs": logprobs, "finish_reasons": reasons,
                "weight_version": self.weight_version}  # fmt: skip

    def update_weights(self, path: str | None = None, blob: bytes | None = None) -> dict:
        """Reload weights in place from a folder of safetensors, or from one safetensors blob."""
        from lightning_vlm.generation.weight_sync import WEIGHTS_FILE, load_into_engine

        with self.lock:
            if blob is not None:
                # Through a file: vLLM's folder loader works whether or not the engine core is in
                # this process, where an in-memory iterator does not.
                target = f"{self.scratch.name}/{WEIGHTS_FILE}"
                with open(target, "wb") as f:
                    f.write(blob)
                path = self.scratch.name
            if not path:
                raise BadRequest("update_weights needs {'path': folder} or a safetensors body")
            seconds = load_into_engine(self.llm, weights_path=path)
            self.weight_version += 1
        return {"seconds": seconds, "weight_version": self.weight_version}

    def call(self, method: str, *args: Any) -> dict:
        """An engine method under the lock (sleep, wake_up, weight-transfer steps)."""
        with self.lock:
            getattr(self.llm, method)(*args)
        return {"ok": True}

    def update_weights_nccl(self, update_info: dict) -> dict:
        """UNTESTED (GPU only): receive one NCCL broadcast of the trainer's weights."""
        from lightning_vlm.generation.weight_sync import reset_vllm_caches

        with self.lock:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": update_info})
            self.llm.finish_weight_update()
            reset_vllm_caches(self.llm)
            self.weight_version += 1
        return {"weight_version": self.weight_version}


def make_handler(engine: Engine, max_body: int) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to one engine."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/health":
                return self._send(404, {"error": f"no GET {self.path}"})
            self._send(
                200, {"status": "ok", "model": engine.args.model, "weight_version": engine.weight_version}
            )

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > max_body:
                    self.close_connection = True
                    raise BadRequest(f"request body {length} B exceeds --max-request-mb ({max_body} B)", 413)
                raw = self.rfile.read(length)
                self._send(200, self._route(raw))
            except BadRequest as exc:
                self._send(exc.status, {"error": str(exc)})
            except Exception as exc:  # the server keeps serving; the client sees the reason
                log.exception("request %s failed", self.path)
                self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

        def _route(self, raw: bytes) -> dict:
            if (
                self.path == "/update_weights"
                and self.headers.get("Content-Type") == "application/octet-stream"
            ):
                return engine.update_weights(blob=raw)
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError as exc:
                raise BadRequest(f"body is not JSON: {exc}") from exc
            routes = {
                "/generate": lambda: engine.generate(body),
                "/update_weights": lambda: engine.update_weights(path=body.get("path")),
                "/sleep": lambda: engine.call("sleep", int(body.get("level", 1))),
                "/wake_up": lambda: engine.call("wake_up"),
                "/init_weight_transfer": lambda: engine.call("init_weight_transfer_engine", body),
                "/update_weights_nccl": lambda: engine.update_weights_nccl(body["update_info"]),
            }
            if self.path not in routes:
                raise BadRequest(f"no POST {self.path}; endpoints: {sorted(routes)}", 404)
            return routes[self.path]()

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (engine options named as in the colocated generator)."""
    p = argparse.ArgumentParser(prog="lightning-vlm-serve", description=__doc__.split("\n")[0])
    p.add_argument("model", help="model folder (transformers format, as saved by VLM.save_pretrained)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--model-impl", default="vllm", choices=("auto", "vllm", "transformers"))
    p.add_argument("--max-images", type=int, default=1, help="images per prompt (limit_mm_per_prompt)")
    p.add_argument("--max-image-pixels", type=int, default=4_000_000, help="larger images are downscaled")
    p.add_argument("--max-request-mb", type=float, default=1024.0, help="larger request bodies get HTTP 413")
    p.add_argument("--logprobs-mode", default="processed_logprobs")
    p.add_argument("--weight-transfer", default=None, choices=(None, "nccl"), help="GPU fast path (untested)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_images < 1 or args.max_image_pixels < 1:
        p.error("--max-images and --max-image-pixels must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    """Start the engine, then serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    start = time.perf_counter()
    engine = Engine(args)
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(engine, int(args.max_request_mb * 2**20))
    )
    # SIGTERM (the test's or a scheduler's stop) ends serve_forever like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    host, port = server.server_address[:2]
    log.info("ready in %.1f s: http://%s:%s (model %s)", time.perf_counter() - start, host, port, args.model)
    print(f"LIGHTNING_VLM_SERVE_READY http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.scratch.cleanup()
        log.info("stopped")


if __name__ == "__main__":
    main()
