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


def model_image_token_in(text: str) -> str | None:
    """The first model image token ``text`` holds (``MODEL_IMAGE_TOKENS``), or None."""
    return next((t for t in MODEL_IMAGE_TOKENS if t in text), None)


def text_blocks(text: str) -> list[dict]:
    """``text`` as typed blocks: an image block at each ``<image>``, the text around it kept as written
    (pieces of whitespace only between placeholders dropped). ``ValueError`` for a model's image token."""
    if token := model_image_token_in(text):
        raise ValueError(
            f"holds the model image token {token!r}: write {IMAGE_PLACEHOLDER!r} where the image goes (or "
            "give each image a {'type': 'image'} block), and the model's chat template writes its own token"
        )
    if IMAGE_PLACEHOLDER not in text:
        return [{"type": "text", "text": text}]
    blocks: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            blocks.append({"type": "image"})
        if piece.strip():
            blocks.append({"type": "text", "text": piece})
    return blocks
