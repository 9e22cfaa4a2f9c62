"""Preference rows -> one batch of 2B sequences (chosen and rejected of each pair side by side).

The prompt (with its images) is processed once per pair and repeated for both answers, exactly as
online RL repeats a prompt for its G completions; the answers are tokenised apart from the prompt,
after the generation prompt, i.e. the tokens greedy generation would have to produce. Rows
``2i`` and ``2i + 1`` are pair i's chosen and rejected answers and share image group i, so the
vision tower runs once per pair (see ``lightning_vlm.models.vision_cache``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_vlm.models.encoding import assistant_char_spans, row_summary, warn_trains_on_nothing
from lightning_vlm.models.image_tokens import repeat_samples
from lightning_vlm.models.vision_cache import repeated_groups, with_image_groups
from lightning_vlm.recurring import warn_recurring

log = logging.getLogger(__name__)


@dataclass
class PairBatch:
    """Encoded answers: ``inputs`` (for pairs 2B rows, chosen at even rows; ``encode_columns``: B rows) and
    the answer-token mask."""

    inputs: dict
    completion_mask: torch.Tensor
    num_pairs: int


def answer_ids(vlm, prompt: list[dict], answer: list[dict], where: str) -> list[int]:
    """Token ids of ``answer`` (assistant messages) after ``prompt``'s generation prompt, up to its end-of-turn:
    the tokens greedy generation would have to produce. Located as SFT locates its trained turns
    (``assistant_char_spans``), so a generation prompt's prefill (Gemma 4 12B+) and a template that closes
    no answer (LLaVA-1.5's) are handled alike in both."""
    try:
        text, spans = assistant_char_spans(vlm.processor, prompt + answer, vlm.end_of_turn, len(prompt))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    if not spans:
        raise ValueError(f"{where}: the answer holds no assistant message")
    return vlm.tokenizer(text[spans[0][0] : spans[-1][1]], add_special_tokens=False)["input_ids"]


def encode_pairs(
    vlm, rows: list[dict], max_length: int | None = None, one_vision_pass: bool = True
) -> PairBatch:
    """Preference rows -> :class:`PairBatch`; ``max_length`` cuts answers (never the prompt) from the right."""
    prompts, completions = _prompts_and_answers(
        vlm, rows, max_length, ("chosen", "rejected"), warn_alike=True
    )
    inputs = vlm.encode_prompt_completion(repeat_samples(prompts, 2, vlm.config), completions)
    if one_vision_pass:
        inputs = with_image_groups(inputs, repeated_groups(len(rows), 2))
    return PairBatch(inputs=inputs, completion_mask=inputs["completion_mask"].bool(), num_pairs=len(rows))


def encode_columns(vlm, rows: list[dict], max_length: int | None, columns: Sequence[str]) -> list[PairBatch]:
    """One batch per column, row i of each holding row i's answer in it after row i's prompt and images.

    The prompts are processed once, and every batch carries the same image extras row for row, so one
    vision pass can serve them all (``vision_cache.with_encoded_images``): KTO runs its matched answers with
    autograd and its mismatched ones without, as two forwards of B sequences.
    """
    k = len(columns)
    prompts, completions = _prompts_and_answers(vlm, rows, max_length, columns)
    batches = []
    for j in range(k):
        inputs = vlm.encode_prompt_completion(prompts, completions[j::k])
        batches.append(PairBatch(inputs, inputs["completion_mask"].bool(), len(rows)))
    return batches


def _prompts_and_answers(
    vlm, rows: list[dict], max_length: int | None, columns: Sequence[str], warn_alike: bool = False
) -> tuple[dict, list[list[int]]]:
    """The encoded prompts [B] and the answers' token ids (entry ``k·i + j``: row i's ``columns[j]``), each
    answer cut to what ``max_length`` leaves after its prompt. ``warn_alike``: the rows are a user's
    preference pairs (not KTO's own pairing of an answer with another row's, which may repeat it)."""
    for i, row in enumerate(rows):
        for column in columns:
            if any(b.get("type") == "image" for m in row[column] for b in _blocks(m)):
                raise ValueError(
                    f"row {i}: images inside {column!r} are not supported; put them in the prompt"
                )
    k = len(columns)
    prompts = vlm.encode_prompts([r["prompt"] for r in rows], [r.get("images", []) for r in rows])
    completions = []
    for i, row in enumerate(rows):
        for column in columns:
            completions.append(answer_ids(vlm, row["prompt"], row[column], f"row {i}, {column!r}"))
    differ = [completions[k * i] != completions[k * i + 1] for i in range(len(rows))] if k == 2 else []
    if warn_alike:
        _warn_rendered_alike(rows, differ)
    if max_length is not None:
        prompt_len = prompts["attention_mask"].sum(dim=1)
        for i, length in enumerate(prompt_len.tolist()):
            room = max_length - length
            if room < 1:
                raise ValueError(
                    f"row {i} of the batch ({row_summary(rows[i])}): the prompt alone has {length} tokens, "
                    f"max_length={max_length} leaves no room for the answer (prompts and their image tokens are "
                    "never truncated); raise max_length, or shrink the images (model.processor_kwargs)"
                )
            for j in range(k * i, k * i + k):
                completions[j] = completions[j][:room]
        if tuple(columns) == ("chosen", "rejected"):
            _warn_cut_to_one_answer(rows, completions, differ, max_length)
    return prompts, completions


def _warn_cut_to_one_answer(
    rows: list[dict], completions: list[list[int]], differed: list[bool], max_length: int
) -> None:
    """Says when truncation left a pair's two answers, which ``differed`` before, the same tokens: its
    loss is a constant (DPO's log 2), so it trains on nothing."""
    same = [i for i in range(len(rows)) if differed[i] and completions[2 * i] == completions[2 * i + 1]]
    warn_trains_on_nothing(max_length, rows, same, "both answers of", "pair", " to the same tokens")


def _warn_rendered_alike(rows: list[dict], differ: list[bool]) -> None:
    """Says when a pair's two answers, different texts (rows.py refuses equal ones), are the same tokens
    once templated (a template that trims each text: "Yes" and "Yes\\n"): its loss is a constant (DPO's
    log 2), so it trains on nothing."""
    same = [i for i, d in enumerate(differ) if not d]
    if same:
        warn_recurring(
            log,
            "rendered_alike",
            "both answers of %d pair%s of this batch render to the same tokens (e.g. %s): the chat template "
            "trims or rewrites them, and such a pair trains on nothing. Make the answers differ in more than "
            "whitespace",
            len(same), "s" if len(same) > 1 else "", row_summary(rows[same[0]]),
        )  # fmt: skip


def _blocks(message: dict) -> list[dict]:
    content = message["content"]
    return [] if isinstance(content, str) else content


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence values [2B] -> (chosen [B], rejected [B])."""
    return values[0::2], values[1::2]
