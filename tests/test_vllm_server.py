"""Server mode on CPU with real vLLM: a ``lightning_vlm.serve`` process started on a free loopback port,
generation and weight updates through the client, GRPO against it, and a clear failure (with the
last checkpoint kept) when it stops. Tests run in file order and share one server (~25 s to start).
"""

from __future__ import annotations

import time

import lightning as L
import pytest
import requests

from lightning_vlm.generation.vllm_server_client import (
    VLLMServerClient,
    VLLMServerError,
    VLLMServerGenerator,
    free_port,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_REQUEST_MB = 8
GRPO = [
    "method=grpo", "generation=vllm_server", "logger=none", "callbacks=none", "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "data.batch_size=2",
    "method.num_generations=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    """(process, url) of a server on 127.0.0.1; stopped at the end of the module."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, url = start_server(tiny_path("qwen2_5_vl"), args=["--max-request-mb", str(MAX_REQUEST_MB)],
                             log_path=str(log))  # fmt: skip
    try:
        VLLMServerClient(url).wait_until_ready(timeout=240)
    except VLLMServerError:
        stop_server(proc)
        pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
    yield proc, url
    stop_server(proc)


def test_unreachable_server_error_names_url_within_timeout():
    url = f"http://127.0.0.1:{free_port()}"
    client = VLLMServerClient(url, timeout=2.0, connect_timeout=0.5, retries=1, backoff=0.1)
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=f"{url}/generate is not reachable"):
        client.generate(["hi"], [], {"n": 1, "max_tokens": 2})
    assert time.monotonic() - start < 10


def test_health_and_clear_errors_for_bad_requests(server):
    _, url = server
    client = VLLMServerClient(url, timeout=30)
    assert client.health()["status"] == "ok" and url.startswith("http://127.0.0.1:")
    with pytest.raises(VLLMServerError, match="400: unsupported sampling fields \\['bogus'\\]"):
        client.generate(["hi"], [], {"n": 1, "bogus": 1})
    with pytest.raises(VLLMServerError, match="413: .*max-request-mb"):
        client.update_weights_from_bytes(b"\0" * (MAX_REQUEST_MB * 2**20 + 1))
    with pytest.raises(VLLMServerError, match="404"):
        client.request("POST", "/nope", json={})
    assert client.health()["status"] == "ok", "the server keeps serving after client errors"


def test_generate_and_weight_updates_match_hf(server, tiny_path):
    from _vllm_scenarios import _compare, _train_step

    from lightning_vlm.models.vlm import VLM

    _, url = server
    vlm = VLM(tiny_path("qwen2_5_vl"))
    generator = VLLMServerGenerator(vlm, VLLMServerClient(url, timeout=60))
    before = _compare(vlm, generator)
    assert before["vllm"] == before["hf"] and before["logprob_max_diff"] < 1e-3
    for transfer in ("folder", "body"):
        _train_step(vlm)
        generator.transfer = transfer
        generator.sync_weights()
        after = _compare(vlm, generator)
        assert after["hf"] != before["hf"], transfer
        assert after["vllm"] == after["hf"] and after["logprob_max_diff"] < 1e-3, transfer
        before = after
    assert generator.client.health()["weight_version"] >= 2
    generator.close()


def test_large_image_is_downscaled_not_hung(server):
    from PIL import Image

    from lightning_vlm.generation.vllm_server_client import encode_image

    _, url = server
    big = encode_image(Image.new("RGB", (2500, 2500), (200, 30, 30)))  # 6.25 Mpx > the 4 Mpx default
    start = time.monotonic()
    out = VLLMServerClient(url, timeout=60).generate(
        ["<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n<|im_start|>assistant\n"],
        [[big]], {"n": 1, "max_tokens": 3, "temperature": 0.0, "logprobs": 0},
    )  # fmt: skip
    assert len(out["completion_ids"]) == 1 and time.monotonic() - start < 60


def test_grpo_against_server_logs_is_stats(server, tmp_path):
    from helpers import compose_train
    from lightning_vlm.training import train

    _, url = server
    cfg = compose_train(
        [*GRPO, "trainer.max_steps=3", f"callbacks.vllm_generation.server_url={url}"], tmp_path
    )
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 3
    for key in (
        "train/is_ratio/mean",
        "train/is_ratio/capped_frac",
        "train/sampler_kl",
        "train/vllm_sync_seconds",
    ):
        assert key in metrics, sorted(metrics)
    assert abs(metrics["train/is_ratio/mean"] - 1.0) < 1e-2
    assert type(objects["module"].generator).__name__ == "HFGenerator"  # restored at teardown


def test_callback_can_start_and_own_a_server(tmp_path):
    from helpers import compose_train
    from lightning_vlm.training import train

    overrides = [*GRPO, "trainer.max_steps=1", "callbacks.vllm_generation.start_server=true",
                 "callbacks.vllm_generation.weight_transfer=body"]  # fmt: skip
    metrics, objects = train(compose_train(overrides, tmp_path))
    callback = next(c for c in objects["trainer"].callbacks if type(c).__name__ == "VLLMGeneration")
    assert "train/is_ratio/mean" in metrics and callback._server_process is None
    with pytest.raises(requests.ConnectionError):  # the server it started is stopped at teardown
        requests.get(f"{callback.server['url']}/health", timeout=1)


class StopServerAfter(L.Callback):
    """Stops the server once ``step`` optimizer steps are done (a server crash mid-run)."""

    def __init__(self, proc, step: int) -> None:
        self.proc, self.step, self.stopped_at = proc, step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step and self.stopped_at is None:
            stop_server(self.proc)
            self.stopped_at = time.monotonic()


def test_stopped_server_fails_clearly_and_keeps_last_checkpoint(server, tmp_path):
    """Runs last: it stops the shared server."""
    import hydra
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers import compose_train
    from lightning_vlm.callbacks.vllm import VLLMGeneration

    proc, url = server
    cfg = compose_train([*GRPO, "trainer.max_steps=6"], tmp_path)
    vlm = hydra.utils.instantiate(cfg.model)
    module = hydra.utils.instantiate(cfg.method, vlm=vlm)
    stopper = StopServerAfter(proc, step=2)
    vllm = VLLMGeneration(mode="server", server_url=url, server_timeout=5.0, connect_timeout=1.0, retries=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=[vllm, ckpt, stopper], logger=False)
    with pytest.raises(VLLMServerError, match=f"vLLM server at {url}/update_weights is not reachable"):
        trainer.fit(module, datamodule=hydra.utils.instantiate(cfg.data))
    assert stopper.stopped_at is not None and time.monotonic() - stopper.stopped_at < 30
    assert (tmp_path / "ckpt" / "last.ckpt").is_file(), "the last checkpoint must survive the failure"
    assert vllm.generator is None and type(module.generator).__name__ == "HFGenerator"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=1)
