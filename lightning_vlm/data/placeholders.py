"""Image placeholders written into text, as ms-swift's, LLaVA's and InternVL's data write them.

Rows hold images as ``{"type": "image"}`` blocks, which the model's chat template turns into its own
image tokens. Data from ms-swift, LLaVA and InternVL writes ``<image>`` into the text where each image goes
instead: it becomes an image block at that place. Data exported for one model may hold that model's own
image token (the processors' ``image_token`` of the registered families): the template would add a second
one per image, so the processor met more tokens than images and raised ``StopIteration``, which Lightning
took for the end of every epoch. Those are refused, as no other family's template reads them.
"""

from __future__ import annotations

IMAGE_PLACEHOLDER = "<image>"
MODEL_IMAGE_TOKENS = ("<|image_pad|>", "<start_of_image>", "<|image|>", "<IMG_CONTEXT>")


# The turn markers (and BOS/EOS) the registered families' chat templates write. In a row's text the
# tokenizer reads one as that control token, not as text: an answer exported already templated, holding
# "<|im_end|>", ended there (SFT's labels stopped at it, the rest never trained on), and a prompt holding
# "<|im_start|>assistant" made a turn of its own. BOS/EOS ("</s>", "<eos>", "<|endoftext|>") and "[INST]"
# are left out: ordinary text (HTML, text about tokenizers, prompts about prompts) holds them.
CHAT_CONTROL_TOKENS = (
    "<|im_start|>", "<|im_end|>",  # Qwen, InternVL, LLaVA-OneVision
    "<start_of_turn>", "<end_of_turn>",  # Gemma 3
    "<|turn>", "<turn|>",  # Gemma 4
    "<end_of_utterance>",  # Idefics3, SmolVLM
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",  # Llama 3
)  # fmt: skip


def model_image_token_in(text: str) -> str | None:
    """The first model image token ``text`` holds (``MODEL_IMAGE_TOKENS``), or None."""
    return next((t for t in MODEL_IMAGE_TOKENS if t in text), None)


def control_token_in(text: str) -> str | None:
    """The chat control token (``CHAT_CONTROL_TOKENS``) that comes first in ``text``, or None."""
    found = [(text.find(t), t) for t in CHAT_CONTROL_TOKENS if t in text]
    return min(found)[1] if found else None


def control_token_error(token: str) -> str:
    """Why text may not hold ``token``, and what to do."""
    return (
        f"holds the chat control token {token!r} (text exported already chat-templated?): the tokenizer reads "
        "it as a turn marker, not as text, so the turn would end or begin there. The model's chat template "
        "writes the turns: give the plain text of each message"
    )


def text_blocks(text: str) -> list[dict]:
    """``text`` as typed blocks: an image block at each ``<image>``, the text around it kept as written
    (pieces of whitespace only between placeholders dropped). ``ValueError`` for a model's image token or a
    chat control token."""
    if token := model_image_token_in(text):
        raise ValueError(
            f"holds the model image token {token!r}: write {IMAGE_PLACEHOLDER!r} where the image goes (or "
            "give each image a {'type': 'image'} block), and the model's chat template writes its own token"
        )
    if token := control_token_in(text):
        raise ValueError(control_token_error(token))
    if IMAGE_PLACEHOLDER not in text:
        return [{"type": "text", "text": text}]
    blocks: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            blocks.append({"type": "image"})
        if piece.strip():
            blocks.append({"type": "text", "text": piece})
    return blocks
