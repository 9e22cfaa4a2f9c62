"""Whether a vLLM server's log-probs are those of the distribution it samples from.

vLLM's default ``--logprobs-mode raw_logprobs`` returns log-probs of the raw logits: before temperature,
top-k/top-p and the logit bias that suppresses image tokens. The trainer compares the sampler's log-probs
with the policy's log-probs of that processed distribution (the importance-sampling correction, the
off-policy mask, ``train/sampler_kl``), so with raw ones every ratio is off, silently. A server the
callback starts, and ``python -m lightning_vlm.serve``, set ``processed_logprobs``; a server started by
hand may not, and a plain vLLM server cannot be asked. So it is probed: the same one-token request at two
temperatures. Processed log-probs of the top tokens move with the temperature; raw ones do not.
"""

from __future__ import annotations

from typing import Protocol

PROBE_TEMPERATURES = (1.0, 0.25)
PROBE_TOP = 5  # top tokens compared: the lower-ranked ones move most with the temperature
# The same forward twice: raw log-probs agree to float noise, processed ones differ by (1/T - 1) times the
# logit gaps, orders of magnitude more for any model whose logits are not all equal.
UNCHANGED = 1e-4


class ChatClient(Protocol):
    """What the probe needs of a server client: ``POST /v1/chat/completions``."""

    url: str

    def chat(self, body: dict) -> dict: ...


def top_logprobs(client: ChatClient, request: dict, temperature: float) -> list[float]:
    """Log-probs of the ``PROBE_TOP`` most likely first tokens of the answer to ``request`` (a chat body with
    every sampling field explicit, ``vllm_server.chat_body``: the server fills a missing one from the
    checkpoint's generation_config, and a top_k there would cut the tokens compared) at ``temperature``."""
    body = {**request, "max_tokens": 1, "temperature": temperature, "seed": 0, "top_logprobs": PROBE_TOP}
    answer = client.chat(body)
    content = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
    if not content:
        raise ValueError(
            f"vLLM server at {client.url} returned no log-probs for a request that asked for them"
        )
    return [float(entry["logprob"]) for entry in content[0].get("top_logprobs") or []]


def returns_processed_logprobs(client: ChatClient, request: dict) -> bool:
    """True unless the server's log-probs stay the same at two temperatures (``raw_logprobs``)."""
    hot, cold = (top_logprobs(client, request, t) for t in PROBE_TEMPERATURES)
    if len(hot) != len(cold) or not hot:
        return True  # not comparable: nothing to refuse on
    return max(abs(a - b) for a, b in zip(hot, cold, strict=True)) > UNCHANGED


def raw_logprobs_message(url: str) -> str:
    """The refusal of a server with raw log-probs, naming the flag that fixes it."""
    return (
        f"vLLM server at {url} returns raw log-probs (vLLM's default --logprobs-mode raw_logprobs): taken "
        "before temperature, top-k/top-p and the bias on suppressed tokens, they are not the log-probs of the "
        "distribution it samples from, which the importance-sampling correction, the off-policy mask and "
        "train/sampler_kl compare with the policy's. Restart it with --logprobs-mode processed_logprobs "
        "(`python -m lightning_vlm.serve` and a server the callback starts set it)"
    )
