"""Rows -> model tensors: SFT (labels on assistant turns), prompts for generation, prompt+completion for RL.

One processor call per batch does tokenisation, image processing and placeholder expansion; the
chat template's own special tokens are kept as rendered, and the tokenizer adds its BOS only where the
template writes none (``chat_render.adds_bos``), as ``apply_chat_template(tokenize=True)`` does.

Assistant labels are found without ``{% generation %}`` markers (few templates have them): turn i
spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of its
end-of-turn token in ``render(messages[:i+1])``. Those character spans are moved through the
processor's placeholder expansion (``return_text_replacement_offsets``) and matched to tokens
through the tokenizer's offsets. A token that straddles a turn's first character is split there
(``token_boundaries``), so prompt and answer are tokenised apart, as in generation and DPO.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from PIL import Image

from lightning_vlm.data.rows import COMPLETION_MESSAGES, LOSS
from lightning_vlm.recurring import warn_recurring

from .chat_render import adds_bos, answer_header, opens_turns, render, warn_unclosed
from .family_rules import image_token_id
from .image_tokens import NUM_IMAGES_KEY
from .token_boundaries import TYPE_ID_KEYS, is_token_key, placeholder_shift, split_straddling

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


def assistant_char_spans(
    processor, messages: list[dict], end_of_turn: str, trained_from: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (incl. end-of-turn)
    from message ``trained_from`` on (a prompt-completion row's completion: see ``COMPLETION_MESSAGES``).

    Where the generation prompt prefills what a finished turn lacks (``answer_header``), the prefill is
    put before each trained turn, as prompt: the answer is trained after what generation conditions on.
    Where the template closes an answer with no end-of-turn (LLaVA-1.5's ends it with a space), it is
    put after each trained answer, as LLaVA was trained: else the model never learns to stop. Where the
    next turn opens with it (GLM-4.1V's ``<|user|>``), an answer followed by a turn is trained up to it,
    and a last answer gets it put after, as GLM's fine-tuning does.
    """
    text = render(processor, messages)
    header, prefill = answer_header(processor)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from or message.get(LOSS) is False:
            continue
        upto = render(processor, messages[: i + 1])
        if i == 0:
            # A conversation opening with the assistant (a greeting): no earlier turns to render (the
            # template gets an empty list and fails); its turn starts after its header, where the
            # generation prompt's header (e.g. "<|im_start|>assistant\n") ends.
            at = upto.find(header) if header else -1
            prefix = upto[: at + len(header)] if at >= 0 else None
        else:
            opened = render(processor, messages[:i], add_generation_prompt=True)
            prefix = opened[: len(opened) - len(prefill)] if opened.endswith(prefill) else None
        if prefix is None or not (
            text.startswith(prefix) and text.startswith(upto) and upto.startswith(prefix)
        ):
            raise ValueError(
                "the chat template does not render this conversation prefix-stably (e.g. it rewrites or drops "
                "earlier turns, as thinking templates do with earlier reasoning), so its assistant tokens "
                "cannot be located. With several assistant turns, train on single-turn rows (or "
                "prompt-completion rows, whose prompt is not trained on); if single-turn rows fail too, the "
                "template's generation prompt is not how it renders a finished answer. Either way, give the "
                "processor a chat template that renders earlier turns unchanged"
            )
        eot = upto.find(end_of_turn, len(prefix))
        if eot >= 0:
            spans.append((len(prefix), eot + len(end_of_turn), ""))
        elif text.startswith(end_of_turn, len(upto)):
            # The next turn opens with it (GLM-4.1V's "<|user|>"): the answer is trained to end there.
            spans.append((len(prefix), len(upto) + len(end_of_turn), ""))
        elif i < len(messages) - 1 and opens_turns(processor, end_of_turn):
            # GLM's answer before a turn that does not open with it (a system turn): putting it there
            # would invent an empty user turn, so the answer is trained as the template renders it.
            spans.append((len(prefix), len(upto), ""))
        else:
            # Right after the answer's text, before the template's trailing space: "red</s>", as LLaVA.
            spans.append((len(prefix), len(upto.rstrip()), end_of_turn))
            if not opens_turns(processor, end_of_turn):
                warn_unclosed(processor, end_of_turn)
    return _with_insertions(text, spans, prefill)


def _with_insertions(
    text: str, spans: list[tuple[int, int, str]], prefill: str
) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with ``prefill`` put where each span ``(start, end, close)`` starts and ``close`` where it
    ends, and the spans moved to cover their answers with their closes."""
    pieces, moved, last, shift = [], [], 0, 0
    for lo, hi, close in spans:
        pieces += [text[last:lo], prefill, text[lo:hi], close]
        shift += len(prefill)
        start = lo + shift
        shift += len(close)
        moved.append((start, hi + shift))
        last = hi
    return "".join(pieces) + text[last:], moved


def row_summary(row: dict) -> str:
    """A row as an error message can name it in a batch: its first user text and its image count (rows do
    not carry their dataset index), e.g. ``"What colour is the shape?..." with 1 image``."""
    messages = row.get("messages") or row.get("prompt") or []
    texts = [
        m["content"] if isinstance(m["content"], str)
        else " ".join(b.get("text") or "" for b in m["content"] if b.get("type") == "text")
        for m in messages if m.get("role") == "user"
    ]  # fmt: skip
    text = " ".join((texts[0] if texts else "").split())
    n = len(row.get("images") or [])
    return f"{text[:60]!r}{'...' if len(text) > 60 else ''} with {n} image{'s' if n != 1 else ''}"


def _images_arg(images: Sequence[Sequence[Image.Image]]):
    return [list(imgs) for imgs in images] if any(len(imgs) for imgs in images) else None


def _check_image_tokens(processor, text: str, images: int) -> None:
    """A rendered text holds one image token per image, as the chat template writes them. A text that held
    the model's own token as well made the processor raise StopIteration (Lightning's end of an epoch: a run
    hung, or skipped the rest of each epoch); in a batch without images the token stayed in the ids. Checked
    where each row is rendered (``_spans``, ``render_prompt``), which name the row."""
    token = getattr(processor, "image_token", None)
    if isinstance(token, str) and token and (found := text.count(token)) != images:
        raise ValueError(
            f"{found} image tokens {token!r} for {images} image{'s' if images != 1 else ''}: its text holds "
            "the model's image token; remove it (each image's {'type': 'image'} block places one)"
        )


def process(processor, texts: list[str], images, padding_side: str, **kwargs) -> dict:
    """One processor call: padded tensors plus the family's image extras and ``num_images``."""
    out = processor(
        text=texts,
        images=_images_arg(images),
        return_tensors="pt",
        padding=True,
        padding_side=padding_side,
        add_special_tokens=adds_bos(processor),
        **kwargs,
    )
    out = dict(out)
    out[NUM_IMAGES_KEY] = torch.tensor([len(imgs) for imgs in images], dtype=torch.long)
    return out


def _spans(processor, row: dict, end_of_turn: str) -> tuple[str, list[tuple[int, int]]]:
    messages = row["messages"]
    trained_from = len(messages) - row.get(COMPLETION_MESSAGES, len(messages))
    try:
        text, spans = assistant_char_spans(processor, messages, end_of_turn, trained_from)
        _check_image_tokens(processor, text, len(row.get("images") or []))
    except ValueError as err:
        raise ValueError(f"SFT row {row_summary(row)}: {err}") from err
    return text, spans


def encode_sft(processor, config, rows: list[dict], end_of_turn: str, max_length: int | None = None) -> dict:
    """Right-padded training tensors; ``labels`` are -100 except on assistant turns (with end-of-turn).

    ``max_length`` truncates from the right; a sample whose last image token lies beyond it raises
    ``ValueError`` (cutting image placeholders breaks the forward, the top complaint of VLM trainers).
    """
    texts, spans = zip(*(_spans(processor, row, end_of_turn) for row in rows), strict=True)
    batch = process(
        processor,
        list(texts),
        [row.get("images", []) for row in rows],
        padding_side="right",
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
    )
    offsets = batch.pop("offset_mapping")
    replacements = batch.pop("text_replacement_offsets", None)
    if replacements is None or isinstance(replacements, torch.Tensor):
        # None, or (InternVL, no image in the batch) an empty tensor: nothing was expanded.
        replacements = [[] for _ in rows]
    # The assistant spans in the expanded text, which the token offsets refer to.
    expanded = [
        [(placeholder_shift(lo, replacements[b]), placeholder_shift(hi, replacements[b])) for lo, hi in row]
        for b, row in enumerate(spans)
    ]
    starts_of_turns = [[lo for lo, _ in row] for row in expanded]
    batch, offsets = split_straddling(
        batch, offsets, starts_of_turns, list(texts), replacements, processor.tokenizer
    )
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    for b, sample_spans in enumerate(expanded):
        starts, ends = offsets[b, :, 0], offsets[b, :, 1]
        for lo, hi in sample_spans:
            inside = (ends > starts) & (starts < hi) & (ends > lo)
            labels[b, inside] = batch["input_ids"][b, inside]
    labels[batch["attention_mask"] == 0] = IGNORE_INDEX
    batch["labels"] = labels
    if max_length is not None:
        try:
            batch = _truncate_right(batch, max_length, image_token_id(config))
        except ValueError as err:
            b = int(str(err).split(":", 1)[0].removeprefix("sample "))
            raise ValueError(f"{err} (the row {row_summary(rows[b])})") from None
        _warn_cut_answers(labels, batch["labels"], rows, max_length)
    return batch


def _warn_cut_answers(before: torch.Tensor, after: torch.Tensor, rows: list[dict], max_length: int) -> None:
    """Says when truncation left a row no answer token: it stays in the batch and trains on nothing."""
    lost = [
        b for b in range(len(rows)) if (before[b] != IGNORE_INDEX).any() and (after[b] == IGNORE_INDEX).all()
    ]
    warn_trains_on_nothing(max_length, rows, lost, "every answer token of", "row")


def warn_trains_on_nothing(
    max_length: int, rows: list[dict], which: list[int], cut: str, unit: str, result: str = ""
) -> None:
    """Says that ``max_length`` cut ``cut`` the ``which`` rows of this batch (counted as ``unit``s; ``result``:
    what that left), which stay in the batch and train on nothing."""
    if which:
        many = len(which) > 1
        warn_recurring(
            log,
            f"cut {cut} {unit}",
            "max_length=%d cut %s %d %s%s of this batch%s (e.g. %s): %s on nothing. Raise method.max_length, "
            "or shorten the prompts or images (model.processor_kwargs)",
            max_length, cut, len(which), unit, "s" if many else "", result, row_summary(rows[which[0]]),
            "they train" if many else "it trains",
        )  # fmt: skip


def _truncate_right(batch: dict, max_length: int, image_id: int) -> dict:
    lengths = batch["attention_mask"].sum(dim=1)
    is_image = batch["input_ids"] == image_id
    positions = torch.arange(is_image.shape[1]).expand_as(is_image)
    last_image = torch.where(is_image, positions, -1).max(dim=1).values
    for b in range(len(lengths)):
        if lengths[b] > max_length and last_image[b] >= max_length:
            raise ValueError(
                f"sample {b}: {int(lengths[b])} tokens, max_length={max_length} would cut its image tokens "
                f"(last at position {int(last_image[b])}); raise max_length or shrink the image "
                "(e.g. processor_kwargs max_pixels)"
            )
    if batch["input_ids"].shape[1] <= max_length:
        return batch
    return {k: (v[:, :max_length] if is_token_key(k, v, batch) else v) for k, v in batch.items()}


def render_prompt(processor, messages: list[dict], images: Sequence[Image.Image]) -> str:
    """A prompt's text with the generation prompt appended (HF's and vLLM's); a prompt the chat template
    refuses, or whose text holds the model's image token, is named."""
    try:
        text = render(processor, messages, add_generation_prompt=True)
        _check_image_tokens(processor, text, len(images))
    except ValueError as err:
        raise ValueError(f"prompt {row_summary({'prompt': messages, 'images': images})}: {err}") from err
    return text


def encode_prompts(processor, prompts: list[list[dict]], images: Sequence[Sequence[Image.Image]]) -> dict:
    """Left-padded prompts with the generation prompt appended, ready for ``generate``."""
    texts = [render_prompt(processor, messages, imgs) for messages, imgs in zip(prompts, images, strict=True)]
    return process(processor, texts, images, padding_side="left")


def pad_completions(
    completion_ids: Sequence[Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged completions into ``(ids, mask)`` tensors."""
    width = max((len(c) for c in completion_ids), default=0)
    ids = torch.full((len(completion_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(completion_ids), width), dtype=torch.long)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = 1
    return ids, mask


def encode_prompt_completion(
    prompt_inputs: dict,
    completion_ids: torch.Tensor | Sequence[Sequence[int]],
    completion_mask: torch.Tensor | None,
    pad_token_id: int,
) -> dict:
    """Left-padded prompt + right-padded completion, with ``completion_mask`` over the full length.

    ``completion_ids`` are lists of ids (padded here), or a padded tensor with its ``completion_mask``.

    Token type ids are extended with zeros for the completion, in the same concatenation as
    ``input_ids``, so they cannot drift apart (TRL #5785). Image extras are carried unchanged.
    """
    if not isinstance(completion_ids, torch.Tensor):
        completion_ids, ragged_mask = pad_completions(completion_ids, pad_token_id)
        completion_mask = ragged_mask if completion_mask is None else completion_mask
    if completion_mask is None:
        # A padded tensor (generate's output) says nothing of where each completion ends: the padding after
        # its end of turn would be scored as completion tokens.
        raise ValueError(
            "completion_ids given as a padded tensor need completion_mask (1 up to and including each "
            "completion's end of turn); or pass the completions as lists of token ids"
        )
    prompt_ids = prompt_inputs["input_ids"]
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"{prompt_ids.shape[0]} prompts but {completion_ids.shape[0]} completions; repeat the prompts "
            "first (image_tokens.repeat_samples)"
        )
    completion_ids = completion_ids.to(prompt_ids.device)
    completion_mask = completion_mask.to(prompt_ids.device, prompt_inputs["attention_mask"].dtype)
    # Masked completion positions hold the pad id, never a stray sampled token.
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    out = {k: v for k, v in prompt_inputs.items() if k not in ("input_ids", "attention_mask", *TYPE_ID_KEYS)}
    out["input_ids"] = torch.cat([prompt_ids, completion_ids], dim=1)
    out["attention_mask"] = torch.cat([prompt_inputs["attention_mask"], completion_mask], dim=1)
    out["completion_mask"] = torch.cat(
        [torch.zeros_like(prompt_inputs["attention_mask"]), completion_mask], dim=1
    )
    for key in TYPE_ID_KEYS:
        if key in prompt_inputs:
            out[key] = torch.cat([prompt_inputs[key], torch.zeros_like(completion_ids)], dim=1)
    return out
