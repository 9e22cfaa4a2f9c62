"""Jinja chat templates of the tiny VLMs, in each family's usual turn format."""

from __future__ import annotations


def _blocks(image: str, role_expr: str, end: str, generation_prompt: str, bos: str = "") -> str:
    """A Jinja chat template rendering typed content blocks (or plain strings) turn by turn.

    The assistant's text sits in a ``{% generation %}`` block so processors can return an
    assistant-token mask; ``end`` closes every turn and is the eos used for generation.
    """
    content = (
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for block in message['content'] -%}"
        "{%- if block['type'] == 'image' -%}{{ '" + image + "' }}"
        "{%- elif block['type'] == 'text' -%}{{ block['text'] }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
    )
    return (
        ("{{- '" + bos + "' -}}" if bos else "")
        + "{%- for message in messages -%}{{- "
        + role_expr
        + " -}}"
        + "{%- if message['role'] == 'assistant' -%}{%- generation -%}"
        + content
        + "{{- '"
        + end
        + "' -}}{%- endgeneration -%}{{- '\\n' -}}"
        + "{%- else -%}"
        + content
        + "{{- '"
        + end
        + "\\n' -}}{%- endif -%}{%- endfor -%}"
        + "{%- if add_generation_prompt -%}{{- '"
        + generation_prompt
        + "' -}}{%- endif -%}"
    )


_IM_ROLE = "'<|im_start|>' + message['role'] + '\\n'"

QWEN_TEMPLATE = _blocks(
    "<|vision_start|><|image_pad|><|vision_end|>", _IM_ROLE, "<|im_end|>", "<|im_start|>assistant\\n"
)
LLAVA_TEMPLATE = _blocks("<image>\\n", _IM_ROLE, "<|im_end|>", "<|im_start|>assistant\\n")
GEMMA3_TEMPLATE = _blocks(
    "<start_of_image>",
    "'<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'",
    "<end_of_turn>",
    "<start_of_turn>model\\n",
    bos="<bos>",
)
IDEFICS3_TEMPLATE = _blocks(
    "<image>",
    "('<|im_start|>' if loop.first else '') + message['role'] | capitalize + ':' "
    "+ ('' if message['content'] is not string and message['content'][0]['type'] == 'image' else ' ')",
    "<end_of_utterance>",
    "Assistant:",
)
# Gemma 4 puts its image token; the processor (and vLLM) expand it to <|image> N x <|image|> <image|>.
GEMMA4_TEMPLATE = _blocks(
    "<|image|>",
    "'<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'",
    "<turn|>",
    "<|turn>model\\n",
    bos="<bos>",
)
# InternVL3-hf: one <IMG_CONTEXT> line per image, expanded to <img> tiles x <IMG_CONTEXT> </img>.
INTERNVL_TEMPLATE = _blocks("<IMG_CONTEXT>\\n", _IM_ROLE, "<|im_end|>", "<|im_start|>assistant\\n")
# GLM-4.1V's format ([gMASK]<sop>, <|role|> headers), as its checkpoints' template renders it: no token
# closes a turn (the model ends an answer with the next turn's <|user|>), and system and assistant
# content is printed as it is, a string expected.
_GLM4V_USER = (
    "{%- if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
)
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}"
    "{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>{{ '\\n' }}"
    + _GLM4V_USER
    + "{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
