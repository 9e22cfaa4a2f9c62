"""Tokens that straddle the first character of an assistant turn, split there.

A generation prompt often ends in whitespace (Gemma 3's ``<start_of_turn>model\\n``), and an answer that
starts with whitespace (``\\n\\nred``) merges with it into one token when the conversation is tokenised
whole (``\\n\\n\\n``). Generation never produces that token (the prompt already holds its first
character); DPO, KTO and the online methods tokenise the answer apart from the prompt, and SFT labelled the
merged token as the answer's first. Each such token is replaced by the tokens of its two parts, so an
SFT row holds the prompt's and the answer's tokens as they are tokenised apart, as everywhere else.
"""

from __future__ import annotations

import torch

TYPE_ID_KEYS = ("token_type_ids", "mm_token_type_ids")


def is_token_key(key: str, value, batch: dict) -> bool:
    """Whether ``batch[key]`` holds one value per token (cut, padded and split with ``input_ids``)."""
    return (
        key in ("input_ids", "attention_mask", "labels", *TYPE_ID_KEYS)
        and value.shape == batch["input_ids"].shape
    )


def placeholder_shift(pos: int, replacements: list[dict], expanded: bool = False) -> int:
    """``pos`` in the rendered text moved into the processor's placeholder-expanded text (each
    placeholder before it grew by len(new) - len(old) characters), or with ``expanded`` a position of
    the expanded text moved back (it must lie outside every placeholder)."""
    shift = 0
    for r in replacements:
        (old_start, old_end), (new_start, new_end) = r["span"], r["new_span"]
        if (new_end if expanded else old_end) <= pos:
            shift += (new_end - new_start) - (old_end - old_start)
    return pos - shift if expanded else pos + shift


def split_straddling(
    batch: dict,
    offsets: torch.Tensor,
    boundaries: list[list[int]],
    texts: list[str],
    replacements: list[list[dict]],
    tokenizer,
) -> tuple[dict, torch.Tensor]:
    """``batch`` and its token ``offsets`` with every token that spans a boundary (a character position of
    the expanded text, per row) replaced by the tokens of its two parts; rows stay right-padded."""
    plans: list[dict[int, tuple[list[int], list[tuple[int, int]]]]] = []
    for b, row_bounds in enumerate(boundaries):
        starts, ends = offsets[b, :, 0], offsets[b, :, 1]
        real = batch["attention_mask"][b] == 1
        plan = {}
        for cut in row_bounds:
            for p in ((starts < cut) & (ends > cut) & real).nonzero().flatten().tolist():
                s, e = int(starts[p]), int(ends[p])
                if any(r["new_span"][0] < e and s < r["new_span"][1] for r in replacements[b]):
                    # Part of an expanded image placeholder (Gemma 3 wraps its image in "\n\n"): its text
                    # is not in the rendered conversation, so the token is left whole.
                    continue
                text = texts[b][
                    placeholder_shift(s, replacements[b], True) : placeholder_shift(e, replacements[b], True)
                ]
                head, tail = text[: cut - s], text[cut - s :]
                enc = tokenizer([head, tail], add_special_tokens=False, return_offsets_mapping=True)
                ids = enc["input_ids"][0] + enc["input_ids"][1]
                offs = [(s + x, s + y) for x, y in enc["offset_mapping"][0]]
                offs += [(cut + x, cut + y) for x, y in enc["offset_mapping"][1]]
                plan[p] = (ids, offs)
        plans.append(plan)
    if not any(plans):
        return batch, offsets
    width = batch["input_ids"].shape[1]
    sources = [
        [p for p in range(width) for _ in range(len(plan[p][0]) if p in plan else 1)] for plan in plans
    ]
    new_width = max(map(len, sources))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {k: v for k, v in batch.items() if not is_token_key(k, v, batch)}
    for key, value in batch.items():
        if is_token_key(key, value, batch):
            fill = pad_id if key == "input_ids" else 0
            out[key] = value.new_full((value.shape[0], new_width), fill)
    new_offsets = offsets.new_zeros((offsets.shape[0], new_width, 2))
    for b, (plan, src) in enumerate(zip(plans, sources, strict=True)):
        index = torch.tensor(src)
        for key in out:
            if is_token_key(key, batch.get(key), batch):
                out[key][b, : len(src)] = batch[key][b, index]
        new_offsets[b, : len(src)] = offsets[b, index]
        at = 0
        for p in range(width):
            if p in plan:
                ids, offs = plan[p]
                out["input_ids"][b, at : at + len(ids)] = torch.tensor(ids)
                new_offsets[b, at : at + len(ids)] = torch.tensor(offs)
                at += len(ids)
            else:
                at += 1
    return out, new_offsets
