"""ShareGPT's conversations, as LLaVA's instruction data holds them: ``conversations`` of
``{"from": "human" | "gpt" | "system", "value": text}``, the image written as ``<image>`` in the text
(``placeholders.py``). Read as rows' ``messages`` of ``{"role", "content"}``, so LLaVA-Instruct JSON trains
as it is, without a conversion script."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONVERSATIONS = "conversations"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def from_sharegpt(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with ShareGPT's ``from``/``value`` as ``role``/``content``; any other message as it is. An
    unknown speaker keeps its name as the role, which the row check then refuses, naming it."""
    if "role" in message or "from" not in message or "value" not in message:
        return message
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    return {"role": ROLES.get(message["from"], message["from"]), "content": message["value"], **rest}
