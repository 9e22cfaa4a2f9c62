"""Sampling on a vLLM server (``/v1/chat/completions``) and pushing the policy's weights to it.

One chat request per prompt row asks for its ``num_generations`` completions (``n``), with that row's
seed, the token ids (``return_token_ids``) and each chosen token's log-prob; the rows' requests run
concurrently, so vLLM batches them. Sampling matches ``HFGenerator`` (``sampling_kwargs``).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from lightning_vlm.generation.base import Rollouts, SamplingSettings
from lightning_vlm.generation.logprobs_probe import raw_logprobs_message, returns_processed_logprobs
from lightning_vlm.generation.vllm_sampling import build_rollouts, request_seeds, sampling_kwargs
from lightning_vlm.generation.vllm_server_client import VLLMServerClient, VLLMServerError
from lightning_vlm.generation.weight_sync import (
    check_syncable,
    policy_weights,
    weights_to_bytes,
    write_weights,
)
from lightning_vlm.models.chat_render import adds_bos, render
from lightning_vlm.models.family_rules import image_token_id

log = logging.getLogger(__name__)
TRANSFERS = ("folder", "body")
MAX_SAMPLING_ATTEMPTS = 3  # generations of one batch redone after a reconnect, before giving up
# The text-only prompt the server's rendering and log-probs are probed with.
PROBE_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "What colour is the shape?"}]}]


def image_url(image: Any) -> str:
    """A PIL image as a PNG data URL (lossless: vLLM sees the trainer's pixels)."""
    buffer = io.BytesIO()
    # zlib level 1, not PIL's 6: on a 12-megapixel photo 4.4x as fast to encode for a body 7 % larger
    # (benchmarks/image_budget.py); level 0 halves the time again but doubles the body.
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def openai_messages(messages: list[dict], images: list[Any]) -> list[dict]:
    """Our messages (``{"type": "image"}`` blocks, images beside them) in OpenAI's chat format."""
    urls = iter([image_url(im) for im in images])
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(urls)}} if block["type"] == "image" else block
                for block in content
            ]
        out.append({**message, "content": content})
    return out


def _shape(messages: list[dict]) -> tuple[bool, bool]:
    """What a prompt holds that templates render their own way: a system turn, an earlier answer."""
    roles = {m["role"] for m in messages}
    return "system" in roles, "assistant" in roles


def _text_turn(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def chat_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``sampling_kwargs`` (vLLM ``SamplingParams`` names) as chat-completion fields."""
    body = {k: v for k, v in kwargs.items() if k not in ("logprobs", "logit_bias") and v is not None}
    # Explicit zeros: a field left out is filled from the checkpoint's generation_config by vLLM's
    # server, and neither HF generate nor the colocated engine applies these penalties.
    body.update(presence_penalty=0.0, frequency_penalty=0.0)
    if kwargs.get("logit_bias"):
        body["logit_bias"] = {str(k): v for k, v in kwargs["logit_bias"].items()}
    # The chosen token's log-prob (no alternatives) and the ids, not only the text.
    body.update(logprobs=True, top_logprobs=0, return_token_ids=True)
    return body


class VLLMServerGenerator:
    """A ``Generator`` sampling on a vLLM server, which it keeps on the policy's weights.

    Weights go as safetensors in a folder the server reads (``transfer="folder"``: a shared
    filesystem) or in the request body (``"body"``, our plugin only). Each push is labelled with a
    weight version; before sampling, a server whose version differs (it restarted) gets the policy again.
    """

    is_policy = False

    def __init__(
        self, vlm: Any, client: VLLMServerClient, transfer: str = "folder", sync_dir: str | None = None,
        max_concurrency: int = 16,
    ) -> None:  # fmt: skip
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        check_syncable(vlm)  # the server takes the merged weights
        self.vlm = vlm
        self.client = client
        self.transfer = transfer
        self.plugin = client.plugin_info() is not None
        if transfer == "body" and not self.plugin:
            raise VLLMServerError(
                f"{client.url} is a plain vLLM server: weight_transfer=body needs lightning_vlm's plugin "
                "(start it with `python -m lightning_vlm.serve`, or VLLM_PLUGINS=lightning_vlm)"
            )
        log.info("vLLM server at %s: %s", client.url,
                 "lightning_vlm.serve (checked weight updates)" if self.plugin else "plain vLLM (dev-mode updates)")  # fmt: skip
        self._tmp = None if sync_dir else tempfile.TemporaryDirectory(prefix="lightning-vlm-sync-")
        self.sync_dir = Path(sync_dir or self._tmp.name)
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm-server")
        # As many pooled connections as threads (requests keeps 10 by default).
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency)
        client.session.mount("http://", adapter)
        client.session.mount("https://", adapter)
        self.seed: int | None = None
        self.version: str | None = None  # the label of the policy's last push; None before the first
        self._pushes = 0
        self._folders: list[Path] = []  # this generator's pushes (only these are ever deleted)
        self._sharded = False
        self.resyncs = 0
        self._rendering_checked: set[tuple[bool, bool]] = set()  # prompt shapes checked (see _shape)
        self._images_checked = False  # image tokens per image compared with the policy's, once
        self._logprobs_checked = False  # the server's log-probs mode, probed at the first sampled generation

    def _check_rendering(self, shape: tuple[bool, bool]) -> None:
        """Refuse a server whose chat template renders a prompt unlike the policy's: its completions would
        answer another prompt than the one trained on. One probe per shape (``_shape``: a system turn or
        not, an earlier answer or not), text only; the server returns the token ids it rendered
        (``return_token_ids``)."""
        system, answered = shape
        messages = list(PROBE_MESSAGES)
        if answered:
            messages += [_text_turn("assistant", "Red."), _text_turn("user", "And now?")]
        if system:
            messages.insert(0, _text_turn("system", "Answer in one word."))
        special = adds_bos(self.vlm.processor)
        ours = self.vlm.tokenizer(
            render(self.vlm.processor, messages, add_generation_prompt=True), add_special_tokens=special
        )["input_ids"]
        answer = self.client.chat(
            {"messages": messages, "max_tokens": 1, "return_token_ids": True, "add_special_tokens": special}
        )
        theirs = answer.get("prompt_token_ids")
        if theirs is not None and list(theirs) != list(ours):
            said = " and ".join(
                [f"{'with' if system else 'without'} a system turn", *(["with an earlier answer"] * answered)]
            )
            raise VLLMServerError(
                f"vLLM server at {self.client.url} renders a prompt {said} unlike the policy: it gives "
                f"{self.vlm.tokenizer.decode(theirs)!r}, the policy {self.vlm.tokenizer.decode(ours)!r}. Serve "
                "the policy's model folder with `python -m lightning_vlm.serve` (it passes system and "
                "assistant content as text to templates that print it as it is, Gemma 4's and GLM-4.1V's), "
                "or give the server the policy's chat template (--chat-template)"
            )
        self._rendering_checked.add(shape)

    def _check_logprobs(self) -> None:
        """Refuse a server whose log-probs are raw (vLLM's default mode), not those of the distribution it
        samples from (``logprobs_probe``); probed with neutral sampling but for the temperature."""
        neutral = chat_body(
            sampling_kwargs(SamplingSettings(max_new_tokens=1), 1, self.vlm.end_of_turn_id, [])
        )
        probe = {**neutral, "messages": PROBE_MESSAGES, "add_special_tokens": adds_bos(self.vlm.processor)}
        if not returns_processed_logprobs(self.client, probe):
            raise VLLMServerError(raw_logprobs_message(self.client.url))
        self._logprobs_checked = True

    def _check_image_tokens(self, rows: list[dict], answers: list[dict]) -> None:
        """Refuse a server that turns an image into another number of image tokens than the policy's processor
        (a server started by hand, without the model config's ``processor_kwargs``: Qwen2.5-VL's
        ``max_pixels``): its completions answer another prompt than the one trained and scored. Compared on
        the first prompt with images; the server returns the token ids it rendered (``return_token_ids``)."""
        at = next((i for i, r in enumerate(rows) if r.get("images")), None)
        theirs = answers[at].get("prompt_token_ids") if at is not None else None
        if theirs is None:
            return
        self._images_checked = True
        token = image_token_id(self.vlm.config)
        row = rows[at]
        ours = self.vlm.encode_prompts([row["prompt"]], [row["images"]])["input_ids"][0].tolist()
        if (n_theirs := list(theirs).count(token)) != (n_ours := ours.count(token)):
            raise VLLMServerError(
                f"vLLM server at {self.client.url} turns a prompt's {len(row['images'])} image(s) into {n_theirs} "
                f"image tokens, the policy's processor into {n_ours}: the server's image processor has other "
                f"settings, and its completions would answer another prompt than the one trained on. Start it "
                f"with the policy's model.processor_kwargs (--mm-processor-kwargs "
                f"'{json.dumps(dict(self.vlm.processor_kwargs or {}))}'), or let the callback start it "
                "(start_server=true)"
            )

    def set_seed(self, seed: int | None) -> None:
        """Seed the following generations (one vLLM seed per prompt, ``request_seeds``); None: unseeded."""
        self.seed = seed

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """``num_generations`` completions per row (consecutive), cut after the end-of-turn token."""
        vlm = self.vlm
        params = chat_body(
            sampling_kwargs(sampling, num_generations, vlm.end_of_turn_id, vlm.suppressed_token_ids)
        )
        for shape in sorted({_shape(r["prompt"]) for r in rows} - self._rendering_checked):
            self._check_rendering(shape)
        if not sampling.greedy and not self._logprobs_checked:  # greedy answers' log-probs feed nothing
            self._check_logprobs()
        seeds = request_seeds(self.seed, len(rows), num_generations)
        bodies = [
            {**params, "messages": openai_messages(r["prompt"], r.get("images", [])),
             "add_special_tokens": adds_bos(vlm.processor), **({"seed": s} if s is not None else {})}
            for r, s in zip(rows, seeds, strict=True)
        ]  # fmt: skip
        for attempt in range(1, MAX_SAMPLING_ATTEMPTS + 1):
            version = self.ensure_weights()
            reconnects = self.client.reconnects
            answers = list(self.pool.map(self.client.chat, bodies))
            if self.client.reconnects == reconnects:
                break
            if attempt == MAX_SAMPLING_ATTEMPTS:  # a server that keeps crashing on these requests
                raise VLLMServerError(f"vLLM server at {self.client.url} restarted during each of {attempt} "
                                      "generations of this batch")  # fmt: skip
            # The connection dropped and came back: the answers may come from a restarted server.
            log.warning("vLLM server reconnected during generation: checking its weights, sampling again")
        if not self._images_checked:
            self._check_image_tokens(rows, answers)
        ids, logprobs = [], []
        for answer in answers:
            for choice in sorted(answer["choices"], key=lambda c: c["index"]):
                ids.append([int(t) for t in choice["token_ids"]])
                logprobs.append(
                    [float(t["logprob"]) for t in (choice.get("logprobs") or {}).get("content") or []]
                )
        rollouts = build_rollouts(rows, num_generations, ids, logprobs, vlm.end_of_turn_id, vlm.tokenizer,
                                  "vllm_server", sampling.max_new_tokens, sampling.greedy)  # fmt: skip
        rollouts.extras["weight_version"] = version  # the weights these were sampled with
        return rollouts

    def ensure_weights(self) -> str | None:
        """The server's weight version, after pushing the policy again if the server lost it (restarted).

        Any rank pushes then, not only the one that pushes each step: under DDP every rank holds the
        same weights, and a rank that waited for rank 0 could wait for good, rank 0 having got its
        answers before the restart and moved on into a collective.
        """
        server = self.client.weight_version()
        if self.version is None or server is None or server == self.version:
            return server
        if self._sharded:
            raise VLLMServerError(
                f"vLLM server at {self.client.url} holds weights {server!r}, not {self.version!r} (restarted?); "
                "under FSDP they can only be gathered at a step: resume the run from last.ckpt"
            )
        log.warning("vLLM server at %s holds weights %r, not %r (restarted?): pushing the policy again",
                    self.client.url, server, self.version)  # fmt: skip
        self.resyncs += 1
        self._push(None, self.version)
        return self.version

    def sync_weights(
        self, chunks: Iterable[dict[str, Any]] | None = None, version: str | None = None
    ) -> float:
        """Push the policy (LoRA merged) to the server under ``version``; seconds taken, transfer included.

        ``chunks`` (FSDP units, see ``policy_weights``): with ``transfer="folder"`` each unit is written
        to its own file as it is gathered, so the full model is never in memory at once.
        """
        start = time.perf_counter()
        self._pushes += 1
        self._sharded = chunks is not None
        self._push(chunks, version or f"push-{self._pushes}")
        return time.perf_counter() - start

    def expect_version(self, version: str, sharded: bool = False) -> None:
        """Another process pushed the policy as ``version`` (DDP: rank 0 pushes for all at each step)."""
        self.version = version
        self._sharded = sharded

    def _push(self, chunks: Iterable[dict[str, Any]] | None, version: str) -> None:
        if self.transfer == "body":
            self.client.reload_weights(
                blob=weights_to_bytes(policy_weights(self.vlm, chunks)), version=version
            )
            self.version = version
            return
        # A fresh, uniquely named folder per push (several runs or ranks may share sync_dir): the
        # server reads every *.safetensors of it, none from another push.
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=self.sync_dir, prefix="push-"))
        parts = (
            [policy_weights(self.vlm)] if chunks is None else (policy_weights(self.vlm, [c]) for c in chunks)
        )
        for i, weights in enumerate(parts):
            write_weights(weights, folder, name=f"model-{i:05d}.safetensors")
        if self.plugin:
            self.client.reload_weights(path=str(folder), version=version)
        else:
            # Four requests: a restart between them would leave the label on the checkpoint's weights.
            reconnects = self.client.reconnects
            self.client.reload_weights_dev_mode(str(folder), version)
            if self.client.reconnects != reconnects:
                self.client.reload_weights_dev_mode(str(folder), version)
        self.version = version
        for old in self._folders:
            shutil.rmtree(old, ignore_errors=True)
        self._folders = [folder]

    def sleep(self) -> None:
        """No-op: a server on its own device needs no room for the trainer's backward."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """Close the client and remove this generator's pushes; the server is not ours to stop."""
        self.pool.shutdown(wait=False)
        self.client.close()
        for old in self._folders:
            shutil.rmtree(old, ignore_errors=True)
        if self._tmp is not None:
            self._tmp.cleanup()
