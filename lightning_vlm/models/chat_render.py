"""Chat-templated text, and what a template's generation prompt is, found by rendering probes.

Rows hold message content as typed blocks; templates differ in what they print (Gemma 4 prints a system
turn's content as it is, GLM-4.1V an assistant turn's too) and in how the generation prompt relates to a
finished turn (Gemma 4's 12B/26B/31B templates prefill an empty thought channel that finished turns lack). Each such fact is
found once per processor and chat template by rendering a probe, and cached on the processor.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError

log = logging.getLogger(__name__)

_PROBE = "system-probe-7f3a"
_ANSWER_PROBE = "answer-probe-7f3a"
_USER = {"role": "user", "content": [{"type": "text", "text": "?"}]}
# Text ending with an opening tag: "<think>", "<|channel>" (not "</think>" nor "<channel|>").
_OPENS_BLOCK = re.compile(r"<\|?[A-Za-z_]+>\s*$")


def render(processor, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat-templated text of ``messages`` (image blocks become the family's placeholder).

    A conversation the template refuses (real Gemma 3's and Mistral's raise on turns that do not alternate
    user/assistant) raises ``ValueError`` naming its turns; callers add which row it is.
    """
    as_text = _roles_as_text(processor)
    if as_text:
        messages = [_text_content(m) if m["role"] in as_text else m for m in messages]
    try:
        return processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as err:
        roles = ", ".join(str(m.get("role")) for m in messages)
        raise ValueError(f"the model's chat template refused its turns ({roles}): {err}") from err


def adds_bos(processor) -> bool:
    """Whether text ``render`` returns is tokenised with the tokenizer's special tokens.

    Rendered text holds the template's own special tokens, so it is tokenised without more (no second BOS
    where the template writes one: real Gemma 3's). But where the tokenizer starts every text with BOS and
    the template writes none (LLaVA-1.5's and LLaVA-NeXT-Mistral's; the models were trained with it), the
    tokenizer adds it: transformers' rule for ``apply_chat_template(tokenize=True)``. Only a tokenizer
    that adds nothing but BOS is asked to (one adding EOS as well would close every prompt).
    """

    def probe() -> bool:
        tokenizer = getattr(processor, "tokenizer", processor)  # a VLM's processor may be its tokenizer
        if tokenizer.bos_token is None or tokenizer.bos_token_id is None:
            return False
        plain = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        if tokenizer(_PROBE, add_special_tokens=True)["input_ids"] != [tokenizer.bos_token_id, *plain]:
            return False
        return not render(processor, [_USER], add_generation_prompt=True).startswith(tokenizer.bos_token)

    return _cached(processor, "_lightning_vlm_adds_bos", probe)


def _cached(processor, name: str, probe: Callable[[], Any]) -> Any:
    """``probe()``, computed once per processor and chat template (a test or user may swap templates)."""
    template = getattr(processor, "chat_template", None)
    known, value = getattr(processor, name, (None, None))
    if value is None or known != template:
        value = probe()
        setattr(processor, name, (template, value))
    return value


def _roles_as_text(processor) -> frozenset[str]:
    """The roles whose content the chat template prints as it is, a string expected (Gemma 4's trims a
    system turn's ``messages[0]['content']``, GLM-4.1V's prints system and assistant content): rows hold
    content as blocks, whose list would be printed as its Python repr."""

    def probe() -> frozenset[str]:
        roles = set()
        for role in ("system", "assistant"):
            messages = [_USER, {"role": role, "content": [{"type": "text", "text": _PROBE}]}]
            if role == "system":
                messages.reverse()
            try:
                if f"'text': '{_PROBE}'" in processor.apply_chat_template(messages, tokenize=False):
                    roles.add(role)
            except Exception:  # a template without system turns: rows with one fail where they are rendered
                pass
        return frozenset(roles)

    return _cached(processor, "_lightning_vlm_roles_as_text", probe)


def _text_content(message: dict) -> dict:
    """A message whose content blocks are all text, with its content as one string; one with an image in a
    role the template prints as text is refused (GLM-4.1V's places images in user turns only)."""
    content = message["content"]
    if isinstance(content, str):
        return message
    if any(block.get("type") != "text" for block in content):
        kinds = sorted({str(block.get("type")) for block in content} - {"text"})
        raise ValueError(
            f"the model's chat template prints {message['role']} turns' content as text, so their "
            f"{'/'.join(kinds)} blocks cannot be placed: put images in user turns"
        )
    return {**message, "content": "".join(block.get("text") or "" for block in content)}


def generation_prompt(processor) -> str:
    """What the chat template appends to open the assistant's turn for generation: the role header, and
    for thinking models (Qwen3-VL-Thinking) a prefilled ``<think>``, which completions then lack."""
    bare, opened = render(processor, [_USER]), render(processor, [_USER], add_generation_prompt=True)
    return opened[len(bare) :] if opened.startswith(bare) else ""


def answer_header(processor) -> tuple[str, str]:
    """``(header, prefill)``: the generation prompt split into what a finished assistant turn opens with
    and what generation alone adds after it; ``prefill`` is "" for most templates.

    Gemma 4's 12B/26B/31B templates (thinking off) prefill an empty thought channel
    (``<|turn>model\\n`` + ``<|channel>thought\\n<channel|>``) and render a finished turn without it. A model
    generates its answer after the prefill, so training puts the prefill before each trained answer, as
    prompt, and the answer tokens are those generation produces (TRL's ``apply_chat_template`` refuses them).
    """

    def probe() -> tuple[str, str]:
        opened = generation_prompt(processor)
        answer = {"role": "assistant", "content": [{"type": "text", "text": _ANSWER_PROBE}]}
        try:
            bare, finished = render(processor, [_USER]), render(processor, [_USER, answer])
        except Exception:  # a template that cannot render an answer: rows with one fail where rendered
            return opened, ""
        at = finished.find(_ANSWER_PROBE)
        header = finished[len(bare) : at] if finished.startswith(bare) and at >= 0 else opened
        prefill = opened[len(header) :] if header and opened.startswith(header) else ""
        # A prefill that opens a block ("<think>\n", QwQ-style thinking templates) is the start of the
        # answer's own text: a row's answer carries its reasoning and the "</think>" that closes it, as
        # before. Only a closed one (Gemma's empty channel, Qwen3's "<think>\n\n</think>\n\n") is put
        # before answers that lack it.
        if prefill and not _OPENS_BLOCK.search(prefill):
            return header, prefill
        return opened, ""

    return _cached(processor, "_lightning_vlm_answer_header", probe)


# Passes a text-only content of the roles ``render`` gives as one string (``{roles}``) that way to a template
# that prints it as it is: vLLM's server hands templates that loop over content blocks (most VLMs') every
# message's content as blocks, and Gemma 4's or GLM-4.1V's would print their Python repr.
_AS_TEXT_PRELUDE = (
    "{{%- set _lightning_vlm = namespace(messages=[]) -%}}"
    "{{%- for _message in messages -%}}"
    "{{%- if _message['role'] in {roles} and _message['content'] is not string"
    " and (_message['content'] | rejectattr('type', 'equalto', 'text') | list | length) == 0 -%}}"
    "{{%- set _lightning_vlm.messages = _lightning_vlm.messages + [dict(_message,"
    " content=_message['content'] | map(attribute='text') | join(''))] -%}}"
    "{{%- else -%}}{{%- set _lightning_vlm.messages = _lightning_vlm.messages + [_message] -%}}{{%- endif -%}}"
    "{{%- endfor -%}}"
    "{{%- set messages = _lightning_vlm.messages -%}}"
)


def server_chat_template(processor) -> str | None:
    """The chat template a vLLM server needs to render prompts as ``render`` does, where it differs from
    the processor's (a template printing system or assistant content as it is); None where it does not."""
    roles = _roles_as_text(processor)
    if not roles:
        return None
    return _AS_TEXT_PRELUDE.format(roles=sorted(roles)) + processor.chat_template


def opens_turns(processor, end_of_turn: str) -> bool:
    """Whether ``end_of_turn`` is what the template's user turns open with (GLM-4.1V's ``<|user|>``): its
    models end an answer with it, so a last answer's missing one is the format, not a template's lapse."""

    def probe() -> bool:
        answer = {"role": "assistant", "content": [{"type": "text", "text": _ANSWER_PROBE}]}
        try:
            text = render(processor, [_USER, answer, _USER])
        except ValueError:  # a template refusing the turns: rows with them fail where they are rendered
            return False
        return text.partition(_ANSWER_PROBE)[2].startswith(end_of_turn)

    return _cached(processor, f"_lightning_vlm_opens_turns_{end_of_turn}", probe)


def warn_unclosed(processor, end_of_turn: str) -> None:
    """Say once per processor that its template closes answers with no ``end_of_turn``, which encoding
    then puts after each trained answer (LLaVA-1.5's template ends an answer with a space)."""
    said = processor.__dict__.setdefault("_lightning_vlm_said", set())
    if end_of_turn not in said:
        said.add(end_of_turn)
        log.warning(
            "the chat template closes an assistant answer with no %r (LLaVA-1.5's ends it with a space): it is "
            "put after each trained answer, as generation stops at it; a template that closes answers "
            "silences this", end_of_turn,
        )  # fmt: skip
