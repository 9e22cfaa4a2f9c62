"""What the colocated and the server vLLM generators share: sampling parameters and rollout assembly.

Both must sample exactly like ``HFGenerator``: the family's vision special tokens suppressed, stop
at the end-of-turn token only, and log-probs of the chosen tokens under the *processed*
distribution (suppression, temperature, top-k/p), which is what HF's ``scores`` hold.
"""

from __future__ import annotations

from typing import Any

from lightning_vlm.generation.base import Rollouts, SamplingSettings, cut_at_eos

# vLLM clamps logit_bias to [-100, 100]: -100 leaves a suppressed token exp(-100) of the mass,
# the same as HF's -inf for every practical purpose (argmax and log-probs alike).
SUPPRESS_BIAS = -100.0
# Rollouts.extras key: the sampler is not the policy itself, so the online method must apply the
# importance-sampling correction with these log-probs.
OFF_POLICY_KEY = "is_policy"


def sampling_kwargs(
    sampling: SamplingSettings,
    n: int,
    end_of_turn_id: int,
    suppressed_token_ids: list[int],
    seed: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` (JSON-able, so the server client can send them)."""
    if n < 1:
        raise ValueError(f"num_generations must be >= 1, got {n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    kwargs: dict[str, Any] = {
        # vLLM refuses n > 1 with greedy decoding: one answer per prompt, repeated by build_rollouts (HF
        # decodes once and repeats too).
        "n": 1 if sampling.greedy else n,
        "max_tokens": sampling.max_new_tokens,
        # Stop at end-of-turn only, as HF does with eos_token_id=[end_of_turn_id]: vLLM would also
        # stop at the checkpoint's eos/generation_config ids unless told to ignore them.
        "ignore_eos": True,
        "stop_token_ids": [int(end_of_turn_id)],
        "logit_bias": {int(t): SUPPRESS_BIAS for t in suppressed_token_ids} or None,
        # None is "off" to HF; vLLM's engine refuses it and its server would fill in the checkpoint's value.
        "repetition_penalty": 1.0 if sampling.repetition_penalty is None else sampling.repetition_penalty,
        # The chosen token's log-prob only (0 extra top tokens).
        "logprobs": 0,
        "skip_special_tokens": True,
        "seed": seed,
    }
    if sampling.greedy:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    else:
        kwargs.update(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            min_p=sampling.min_p or 0.0,
        )
    return kwargs


def request_seeds(seed: int | None, num_prompts: int, n: int) -> list[int | None]:
    """One vLLM seed per prompt from a generation's seed (None: unseeded).

    vLLM seeds a prompt's ``n`` completions ``s, s+1, ..., s+n-1``; prompt ``i`` gets
    ``s = base + i·n``, so no two completions of a generation share a stream, and the same seed
    (a resumed step, a validation pass) redraws the same completions.
    """
    if seed is None:
        return [None] * num_prompts
    base = seed * 1_000_003
    return [(base + i * n) % 2**63 for i in range(num_prompts)]


def completions_of(request_outputs: list[Any]) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and chosen-token log-probs of every completion, prompt by prompt (G consecutive)."""
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    for request in request_outputs:
        for completion in request.outputs:
            tokens = [int(t) for t in completion.token_ids]
            ids.append(tokens)
            steps = completion.logprobs or []
            # Each step maps token id -> Logprob; the sampled token is always among them.
            logprobs.append([float(step[t].logprob) for t, step in zip(tokens, steps, strict=False)])
    return ids, logprobs


def build_rollouts(
    rows: list[dict],
    num_generations: int,
    ids: list[list[int]],
    logprobs: list[list[float]],
    end_of_turn_id: int,
    tokenizer: Any,
    sampler: str,
    max_new_tokens: int | None = None,
    greedy: bool = False,
) -> Rollouts:
    """Rollouts as ``HFGenerator`` returns them, cut after end-of-turn, flagged as not the policy.

    ``greedy``: the engine decoded one answer per prompt (``sampling_kwargs``), repeated here
    ``num_generations`` times.

    A completion without end-of-turn shorter than ``max_new_tokens`` was stopped by the engine's
    ``max_model_len`` (prompt + completion): vLLM ends it there silently, where HF would go on. That is
    refused, naming the settings: the rollout would look like an answer cut by the length budget.
    """
    if greedy and len(ids) == len(rows):
        ids = [x for x in ids for _ in range(num_generations)]
        logprobs = [x for x in logprobs for _ in range(num_generations)]
    expected = len(rows) * num_generations
    if len(ids) != expected:
        raise RuntimeError(f"{sampler} returned {len(ids)} completions, expected {expected}")
    kept_ids, kept_logps, truncated = [], [], []
    for tokens, logps in zip(ids, logprobs, strict=True):
        kept, cut = cut_at_eos(tokens, {end_of_turn_id})
        if len(logps) < len(kept):
            raise RuntimeError(f"{sampler} returned {len(logps)} log-probs for {len(kept)} tokens")
        kept_ids.append(kept)
        kept_logps.append(list(logps[: len(kept)]))
        truncated.append(cut)
    if max_new_tokens is not None:
        capped = [
            len(k) for k, cut in zip(kept_ids, truncated, strict=True) if cut and len(k) < max_new_tokens
        ]
        if capped:
            raise ValueError(
                f"{sampler} stopped {len(capped)} of {len(kept_ids)} completions after {min(capped)}-{max(capped)} "
                f"tokens, before method.max_completion_length={max_new_tokens}: the engine's max_model_len "
                "caps prompt + completion. Raise callbacks.vllm_generation.engine.max_model_len (a server you "
                f"started: --max-model-len) to at least the longest prompt, image tokens included, plus "
                f"{max_new_tokens}"
            )
    return Rollouts(
        rows=list(rows),
        completion_ids=kept_ids,
        completion_texts=tokenizer.batch_decode(kept_ids, skip_special_tokens=True),
        truncated=truncated,
        num_generations=num_generations,
        logprobs=kept_logps,
        extras={OFF_POLICY_KEY: False, "sampler": sampler},
    )
