"""ShareGPT's conversations, as LLaVA's instruction data holds them: ``conversations`` of
``{"from": "human" | "gpt" | "system", "value": text}``, the image written as ``<image>`` in the text
(``placeholders.py``). Read as rows' ``messages`` of ``{"role", "content"}``, so LLaVA-Instruct JSON trains
as it is, without a conversion script. LLaMA-Factory's sharegpt rows may carry the system prompt in a
``system`` column beside the conversation: it becomes the conversation's leading system turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CONVERSATIONS = "conversations"
SYSTEM = "system"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def from_sharegpt(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with ShareGPT's ``from``/``value`` as ``role``/``content``; any other message as it is. An
    unknown speaker keeps its name as the role, which the row check then refuses, naming it."""
    if "role" in message or "from" not in message or "value" not in message:
        return message
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    return {"role": ROLES.get(message["from"], message["from"]), "content": message["value"], **rest}


def system_text(value: Any, messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The system prompt a ShareGPT row's ``system`` column holds (LLaMA-Factory's sharegpt format); None
    without one (absent, null or blank: LLaMA-Factory then uses its template's default, here
    ``data.system_prompt``). ValueError for one that is not text, or beside a system turn of the
    conversation (LLaMA-Factory keeps the turn and drops the column without a word)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise ValueError(f"a row's system prompt must be text, got {type(value).__name__} {value!r}")
    if messages and messages[0].get("role") == "system":
        raise ValueError(
            "the row has a system prompt in its 'system' column and a system turn in its conversation "
            "(message 0): which one is meant? keep one"
        )
    return value
