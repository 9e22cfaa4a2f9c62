"""Chat templates the tests swap in, each shaped like a real model's (see where they are used)."""

from __future__ import annotations

# The tiny Qwen's turn format, with a system turn printed as Gemma 4's template prints it: its content
# as it is (``messages[0]['content'] | trim``), a string expected. Blocks would print as their repr.
SYSTEM_AS_IS = (
    "{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content | trim }}<|im_end|>\n"
    "{% endif %}{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for b in m.content %}"
    "{% if b.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ b.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# As SYSTEM_AS_IS, with an assistant turn's content printed as it is too, as GLM-4.1V's template prints it.
TEXT_AS_IS = SYSTEM_AS_IS.replace(
    "{% if m.content is string %}", "{% if m.content is string or m.role == 'assistant' %}"
)
assert TEXT_AS_IS != SYSTEM_AS_IS

# Shaped like llava-hf/llava-1.5's: "USER: <image>\n... ASSISTANT: answer " with images first, and an answer
# closed by a space, no end-of-turn token.
LLAVA_1_5 = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
