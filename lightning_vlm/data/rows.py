"""Normalise and validate raw rows (TRL's column names) into the one row format the methods consume.

A normalised row always has ``images`` (a list; PIL images once loaded) and, by shape:

- ``sft``: ``messages``;
- ``preference``: ``prompt``, ``chosen``, ``rejected`` (the last two: assistant messages only);
- ``prompt``: ``prompt``;
- ``unpaired``: ``prompt``, ``completion`` (assistant messages) and ``label`` (True: desirable), TRL's
  KTO format.

Messages are ``{"role": str, "content": [block, ...]}`` with blocks exactly ``{"type": "image"}`` or
``{"type": "text", "text": str}``. Any other column is passed through unchanged (``solution`` for
reward functions, ids for debugging). Every problem raises :class:`RowError`, naming the row.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_vlm.data.placeholders import text_blocks
from lightning_vlm.data.row_error import RowAt
from lightning_vlm.data.row_images import image_refs
from lightning_vlm.data.sharegpt import CONVERSATIONS, SYSTEM, from_sharegpt, system_text

SHAPES: tuple[str, ...] = ("sft", "preference", "prompt", "unpaired")
# Keys that would carry an image inside a content block; we only support images in the image columns,
# so that the count check below has one place to look.
_EMBEDDED_IMAGE_KEYS = ("image", "url", "path", "base64")


def _text(text: str, at: RowAt, column: str, where: str) -> list[dict]:
    try:
        return text_blocks(text)
    except ValueError as err:
        at.fail(column, "wrong_type", f"{where} {err}")


def _block(block: Any, at: RowAt, column: str, where: str) -> list[dict]:
    if not isinstance(block, Mapping):
        at.fail(
            column,
            "wrong_type",
            f"{where} must be a dict like {{'type': 'text', 'text': ...}}, got {block!r}",
        )
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            at.fail(column, "wrong_type", f"{where} is a text block without a string 'text'")
        return _text(block["text"], at, column, where)  # "<image>" in it: an image block there
    if kind == "image":
        embedded = [k for k in _EMBEDDED_IMAGE_KEYS if block.get(k) is not None]
        if embedded:
            at.fail(
                column,
                "wrong_type",
                f"{where} carries its own image ({embedded[0]!r}); put images in the 'images' column "
                "and leave a bare {'type': 'image'} block where each goes",
            )
        return [{"type": "image"}]
    at.fail(column, "wrong_type", f"{where} has type {kind!r}; expected 'text' or 'image'")


ROLES = ("system", "user", "assistant", "tool")
# ms-swift's per-message flag: an assistant turn with "loss": false is context, not trained on.
LOSS = "loss"


def _conversation(value: Any, at: RowAt, column: str) -> tuple[list[dict], list[bool]]:
    """Normalised messages, and for each whether its content was a plain string (not typed blocks)."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        at.fail(column, "wrong_type", f"expected a non-empty list of messages, got {type(value).__name__}")
    messages, plain = [], []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            at.fail(column, "wrong_type", f"message {i} must be a dict with 'role' and 'content'")
        message = from_sharegpt(message)  # LLaVA's {"from": "human", "value": ...}
        if not isinstance(message.get("role"), str):
            at.fail(column, "wrong_type", f"message {i} has no string 'role'")
        if message["role"] not in ROLES:
            # ShareGPT's human/gpt, or "User": chat templates drop or misplace them, and SFT trains on
            # assistant turns only, so a "gpt" answer was silently never trained on.
            at.fail(
                column, "wrong_type", f"message {i} has role {message['role']!r}; expected one of {ROLES}"
            )
        content = message.get("content")
        plain.append(isinstance(content, str))
        if isinstance(content, str):
            blocks = _text(content, at, column, f"message {i}")
        elif isinstance(content, Sequence):
            blocks = [
                x for j, b in enumerate(content) for x in _block(b, at, column, f"message {i}, block {j}")
            ]
        else:
            at.fail(column, "wrong_type", f"message {i} content must be a string or a list of blocks")
        # Stored datasets fill missing keys with None (Arrow unifies the struct); those are not data.
        extra = {k: v for k, v in message.items() if v is not None and k not in ("role", "content")}
        if not isinstance(extra.get(LOSS, True), bool):
            at.fail(column, "wrong_type", f"message {i} has {LOSS!r}: {extra[LOSS]!r}; expected true or false "
                    "(ms-swift's per-turn flag: false leaves the turn untrained)")  # fmt: skip
        messages.append({"role": message["role"], "content": blocks, **extra})
    return messages, plain


def _text_or_conversation(value: Any, at: RowAt, column: str, role: str) -> tuple[list[dict], list[bool]]:
    if isinstance(value, str):
        return [{"role": role, "content": _text(value, at, column, "the text")}], [True]
    return _conversation(value, at, column)


def _count_images(messages: list[dict]) -> int:
    return sum(b["type"] == "image" for m in messages for b in m["content"])


def _place_images(messages: list[dict], plain: list[bool], n: int) -> None:
    """Put ``n`` image blocks first in the first user turn (``messages[0]`` without one), if the row
    has not placed them itself: that turn was a plain string and no message holds an image block.

    A plain string cannot say where images go; like TRL (which decides per message), they go where a
    chat template takes them without a placeholder. A typed target turn, or an image block anywhere
    (say in a later turn), means the row placed its images, and the count check judges that.
    """
    at = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
    if n and plain[at] and not _count_images(messages):
        messages[at]["content"] = [{"type": "image"} for _ in range(n)] + messages[at]["content"]


def _require(row: Mapping, at: RowAt, column: str) -> Any:
    if row.get(column) is None:
        # Stored datasets hold every file-wide column in every row, None where absent: list real ones.
        present = sorted(k for k, v in row.items() if v is not None)
        at.fail(column, "missing_column", f"missing required column {column!r} (columns: {present})")
    return row[column]


def _common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_count(at: RowAt, column: str, blocks: int, images: int) -> None:
    if blocks != images:
        at.fail(
            column,
            "image_count_mismatch",
            f"{blocks} {{'type': 'image'}} block(s) in the messages but {images} image(s) in the row",
        )


# An SFT row's last N messages that are trained on (its completion); absent: every assistant turn is.
COMPLETION_MESSAGES = "completion_messages"


def _check_answer(at: RowAt, column: str, messages: list[dict]) -> None:
    # SFT trains on assistant tokens only: without an assistant turn the row would add nothing but
    # padding to its batch, silently; an empty one (a missing value written as "") trains the
    # end-of-turn token alone, answering nothing, also beside good turns of the same row.
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get(LOSS) is not False]
    roles = [m["role"] for m in messages]
    if not trained:
        at.fail(column, "no_answer", f"SFT row with no assistant turn trained on (roles: {roles}): it has "
                "nothing to train on")  # fmt: skip
    for i in trained:
        if not any(b["type"] == "text" and b["text"].strip() for b in messages[i]["content"]):
            at.fail(column, "no_answer", f"SFT row with an empty assistant turn, message {i} (roles: {roles}): "
                    "nothing to train on there but its end, which teaches answering nothing")  # fmt: skip


def _check_reply(at: RowAt, column: str, messages: list[dict], preferred: bool) -> None:
    """A preference or KTO answer: assistant text. An image in it failed mid-training, at the batch
    holding the row. An empty ``preferred`` one (chosen, desirable: a missing value written as "") would
    teach answering nothing; an empty rejected or undesirable one is kept (not ending the turn at once is
    a signal; TRL takes both)."""
    if any(m["role"] != "assistant" for m in messages):
        at.fail(column, "wrong_type", f"'{column}' must hold assistant messages only")
    if _count_images(messages):
        at.fail(column, "wrong_type", f"images inside '{column}' are not supported; put them in the prompt")
    if preferred and not any(
        b["text"].strip() for m in messages for b in m["content"] if b["type"] == "text"
    ):
        at.fail(
            column, "no_answer", f"'{column}' is an empty answer to prefer: it would teach answering nothing"
        )


def _check_prompt_end(at: RowAt, column: str, prompt: list[dict]) -> None:
    """A prompt is answered in a new assistant turn. TRL continues one that ends with an assistant turn
    (``continue_final_message``: a prefill such as "<think>"); the chat template here would close that
    turn and open another, so the answer would follow a finished turn instead of continuing it."""
    if prompt and prompt[-1]["role"] == "assistant":
        at.fail(column, "wrong_type", f"'{column}' ends with an assistant turn (message {len(prompt) - 1}), "
                "which TRL continues as a prefill and a new turn here would follow: end it with the "
                "user's turn")  # fmt: skip


def _system_turn(row: Mapping, at: RowAt, messages: list[dict]) -> dict | None:
    """The system message a ShareGPT row's ``system`` column makes (LLaMA-Factory's), or None without one."""
    try:
        text = system_text(row.get(SYSTEM), messages)
    except ValueError as err:
        at.fail(SYSTEM, "wrong_type", str(err))
    return None if text is None else {"role": "system", "content": _text(text, at, SYSTEM, "the text")}


def _label(row: Mapping, at: RowAt) -> bool:
    """KTO's ``label``: a bool (True: desirable; a ClassLabel's, by its names: class_labels.py); 0/1 integers
    are accepted, anything else is an error."""
    value = _require(row, at, "label")
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    at.fail("label", "wrong_type", f"'label' must be true or false (desirable or not), got {value!r}")


def normalize_row(
    row: Mapping,
    shape: str,
    index: int = 0,
    source: str = "data",
    base_dir: str | os.PathLike | None = None,
    check_files: bool = True,
) -> dict:
    """Validate one raw row and return it normalised; images stay references (paths, bytes, PIL)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown data shape {shape!r}; expected one of {SHAPES}")
    at = RowAt(source, index)
    if not isinstance(row, Mapping):
        at.fail("<row>", "wrong_type", f"a row must be a dict, got {type(row).__name__}")
    base = Path(base_dir) if base_dir is not None else None
    images = image_refs(row, at, base, check_files)
    out: dict[str, Any] = {}
    if shape == "sft":
        if (
            row.get("messages") is None
            and row.get("prompt") is not None
            and row.get("completion") is not None
        ):
            # TRL's prompt-completion form: the completion is what is trained on (TRL's
            # completion_only_loss), not assistant turns inside a multi-turn prompt.
            prompt, plain_p = _text_or_conversation(row["prompt"], at, "prompt", "user")
            completion, plain_c = _text_or_conversation(row["completion"], at, "completion", "assistant")
            messages, plain, used = prompt + completion, plain_p + plain_c, ("prompt", "completion")
            # Counted from the end: a system turn put in front later (RowFormat) moves nothing.
            out[COMPLETION_MESSAGES], trained = len(completion), completion
        else:
            # LLaVA's instruction data (ShareGPT) names them `conversations`.
            column = CONVERSATIONS if row.get("messages") is None and row.get(CONVERSATIONS) else "messages"
            messages, plain = _conversation(_require(row, at, column), at, column)
            used, trained = (column,), messages
            if column == CONVERSATIONS and (system := _system_turn(row, at, messages)) is not None:
                messages, plain = [system, *messages], [True, *plain]
        _place_images(messages, plain, len(images))
        _check_count(at, used[0], _count_images(messages), len(images))
        _check_answer(at, used[-1], trained)  # message indices as the row writes them
        out["messages"] = messages
        used = (*used, SYSTEM) if CONVERSATIONS in used else used  # a ShareGPT row's system turn
    elif shape == "preference":
        chosen_raw, rejected_raw = _require(row, at, "chosen"), _require(row, at, "rejected")
        if row.get("prompt") is None:
            if isinstance(chosen_raw, str) or isinstance(rejected_raw, str):
                _require(row, at, "prompt")  # an implicit prompt needs conversations to split
            # TRL's implicit-prompt form: full conversations; the shared prefix is the prompt.
            chosen, plain = _conversation(chosen_raw, at, "chosen")
            rejected, _ = _conversation(rejected_raw, at, "rejected")
            n = _common_prefix(chosen, rejected)
            if n == 0:
                at.fail(
                    "prompt", "missing_column", "no 'prompt' and 'chosen'/'rejected' share no first message"
                )
            if n == len(chosen) or n == len(rejected):
                at.fail(
                    "chosen", "wrong_type", "'chosen' and 'rejected' do not differ after their shared prompt"
                )
            prompt, chosen, rejected, plain = chosen[:n], chosen[n:], rejected[n:], plain[:n]
        else:
            prompt, plain = _text_or_conversation(row["prompt"], at, "prompt", "user")
            chosen, _ = _text_or_conversation(chosen_raw, at, "chosen", "assistant")
            rejected, _ = _text_or_conversation(rejected_raw, at, "rejected", "assistant")
        _check_reply(at, "chosen", chosen, preferred=True)
        _check_reply(at, "rejected", rejected, preferred=False)
        if chosen == rejected:  # no preference: DPO's loss is a constant, KTO's rows contradict each other
            at.fail("chosen", "wrong_type", "'chosen' and 'rejected' are the same answer")
        _check_prompt_end(at, "prompt" if row.get("prompt") is not None else "chosen", prompt)
        _place_images(prompt, plain, len(images))
        _check_count(at, "prompt", _count_images(prompt), len(images))
        out.update(prompt=prompt, chosen=chosen, rejected=rejected)
        used = ("prompt", "chosen", "rejected")
    elif shape == "unpaired":
        prompt, plain = _text_or_conversation(_require(row, at, "prompt"), at, "prompt", "user")
        completion, _ = _text_or_conversation(_require(row, at, "completion"), at, "completion", "assistant")
        out["label"] = _label(row, at)
        _check_reply(at, "completion", completion, preferred=out["label"])
        _check_prompt_end(at, "prompt", prompt)
        _place_images(prompt, plain, len(images))
        _check_count(at, "prompt", _count_images(prompt), len(images))
        out.update(prompt=prompt, completion=completion)
        used = ("prompt", "completion", "label")
    else:
        # ms-swift's GRPO rows hold the prompt as `messages`, whose last assistant answer ms-swift drops
        # (remove_response): kept, the policy would see the answer it is rewarded for.
        column = "messages" if row.get("prompt") is None and row.get("messages") is not None else "prompt"
        prompt, plain = _text_or_conversation(_require(row, at, column), at, column, "user")
        if column == "messages" and len(prompt) > 1 and prompt[-1]["role"] == "assistant":
            prompt, plain = prompt[:-1], plain[:-1]
        _check_prompt_end(at, column, prompt)
        _place_images(prompt, plain, len(images))
        _check_count(at, column, _count_images(prompt), len(images))
        out["prompt"] = prompt
        used = (column,)
    passthrough = {k: v for k, v in row.items() if k not in (*used, "image", "images")}
    return {**passthrough, **out, "images": images}
