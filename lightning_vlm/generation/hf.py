"""Sampling with Hugging Face ``generate``: no extra engine, exact same weights as training."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

from lightning_vlm.generation.base import (
    OwnWeightsGenerator,
    Rollouts,
    SamplingSettings,
    cut_at_eos,
    torch_seeded,
)
from lightning_vlm.models.modes import evaluating
from lightning_vlm.models.vision_every_rank import gathers_weights
from lightning_vlm.models.vlm import PRIVATE_KEYS, VLM
from lightning_vlm.parallel.collectives import world_size


def synced_gpus(vlm: VLM) -> bool:
    """Whether every rank must keep stepping ``generate`` until all ranks are done: their weights are
    gathered in each forward. transformers sees FSDP itself, but ZeRO-3 only through a global config
    that Lightning's DeepSpeed strategy never creates, so a rank done early would leave the others."""
    return world_size() > 1 and gathers_weights(vlm.model)


@contextlib.contextmanager
def without_checkpoint_defaults(model: torch.nn.Module) -> Iterator[None]:
    """Hide the checkpoint's ``generation_config.json`` during ``generate``.

    transformers fills every field a passed config leaves unset from it (min_p, typical_p,
    no_repeat_ngram_size, min_new_tokens, bad_words_ids, ...; Qwen2.5-VL-Instruct ships a near-greedy
    one), and several fields have no neutral value to set instead. Sampling must draw from the
    distribution training computes log-probs of, so the model's defaults are blank for the call.
    """
    from transformers import GenerationMixin

    # A PEFT model copies its config onto the model it wraps inside generate: every model in the chain
    # gets its own back (a LoRA policy's export would otherwise write a blank generation_config.json).
    models = [model, *(m for m in model.modules() if isinstance(m, GenerationMixin) and m is not model)]
    saved = [m.generation_config for m in models]
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in zip(models, saved, strict=True):
            m.generation_config = config


class HFGenerator(OwnWeightsGenerator):
    """Generates with the policy's own HF model, in eval mode and without gradients.

    ``is_policy`` (True): it samples the weights being trained, so no importance-sampling correction
    and nothing to sync. After ``set_seed(s)`` every ``generate`` call draws from torch's RNG seeded
    with ``s`` (in a fork of it: the caller's RNG state is untouched), like vLLM's per-request seeds.

    The family's image/video/vision special tokens are suppressed (a weak model samples them and the
    next training forward then fails); ``VLM.suppressed_token_ids`` is the same list, so training
    log-probs can be renormalised consistently (``token_logps(mask_suppressed=True)``).
    """

    def __init__(self, vlm: VLM, max_batch_size: int | None = None) -> None:
        self.vlm = vlm
        self.max_batch_size = max_batch_size

    def generation_config(self, sampling: SamplingSettings) -> GenerationConfig:
        """Our sampling settings; :func:`without_checkpoint_defaults` keeps the checkpoint's out of the rest."""
        common = dict(
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=[self.vlm.end_of_turn_id],
            pad_token_id=self.vlm.pad_token_id,
            suppress_tokens=self.vlm.suppressed_token_ids or None,
            repetition_penalty=sampling.repetition_penalty,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if sampling.greedy:
            # Only what greedy search reads: sampling fields set here make transformers warn, on every
            # validation, that they "may be ignored" (top_k=0).
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,
            min_p=sampling.min_p or None,
            **common,
        )

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        """``num_generations`` completions per row (consecutive), cut after the end-of-turn token."""
        with self._seeded():
            return self._generate_all(rows, num_generations, sampling)

    @contextlib.contextmanager
    def _seeded(self) -> Iterator[None]:
        if self.seed is None:
            yield
            return
        with torch_seeded(self.seed, next(self.vlm.model.parameters()).device):
            yield

    def _generate_all(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        step = self.max_batch_size or len(rows)
        ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        truncated: list[bool] = []
        for start in range(0, len(rows), step):
            chunk = rows[start : start + step]
            chunk_ids, chunk_logprobs, chunk_truncated = self._generate(chunk, num_generations, sampling)
            ids += chunk_ids
            logprobs += chunk_logprobs
            truncated += chunk_truncated
        texts = self.vlm.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(
            rows=list(rows),
            completion_ids=ids,
            completion_texts=texts,
            truncated=truncated,
            num_generations=num_generations,
            logprobs=logprobs,
        )

    def _generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings):
        vlm = self.vlm
        inputs = vlm.encode_prompts([r["prompt"] for r in rows], [r.get("images", []) for r in rows])
        vlm.check_image_tokens(inputs)
        device = next(vlm.model.parameters()).device
        model_inputs = {k: v.to(device) for k, v in inputs.items() if k not in PRIVATE_KEYS}
        config = self.generation_config(sampling)
        # G completions per prompt as generate's own expansion (rows stay consecutive): transformers
        # encodes each prompt's images once before the prefill and repeats the features, so the vision
        # tower does not run G times. Greedy copies are identical: decode once, repeat the result.
        copies = 1 if sampling.greedy else num_generations
        config.num_return_sequences = copies
        with evaluating(vlm.model), torch.no_grad(), without_checkpoint_defaults(vlm.model):
            out = vlm.model.generate(**model_inputs, generation_config=config, synced_gpus=synced_gpus(vlm))
        new = out.sequences[:, model_inputs["input_ids"].shape[1] :]
        # Scores are the processed logits the token was drawn from (suppression, temperature, top-k/p).
        # Step by step, only the drawn tokens' log-probs [N, T] are kept: stacking the [N, V] steps, with
        # a float copy and a log-softmax, held three [N, T, V] tensors (20 GB each for 64 answers of 512
        # tokens over Qwen's 152k vocabulary) next to the one transformers returns.
        chosen = None
        if out.scores:
            steps = [s.float().log_softmax(-1).gather(1, new[:, t, None]) for t, s in enumerate(out.scores)]
            chosen = torch.cat(steps, dim=1)
        del out
        if copies != num_generations:
            new = new.repeat_interleave(num_generations, dim=0)
            chosen = chosen.repeat_interleave(num_generations, dim=0) if chosen is not None else None
        ids, logprobs, truncated = [], [], []
        for i, row in enumerate(new.tolist()):
            kept, cut = cut_at_eos(row, {vlm.end_of_turn_id})
            ids.append(kept)
            truncated.append(cut)
            logprobs.append([] if chosen is None else chosen[i, : len(kept)].tolist())
        return ids, logprobs, truncated
