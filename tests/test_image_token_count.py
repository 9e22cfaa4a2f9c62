"""A row whose text holds the model's image token (rows built in code skip the data checks of ``rows.py``):
the processor would meet more image tokens than images and raise ``StopIteration``, which Lightning takes
for the end of the epoch (a run hung, or silently skipped the rest of every epoch), or, in a batch
without images, leave the token in the ids to be embedded as text. Both are refused, naming the row."""

from __future__ import annotations

import pytest
from PIL import Image
from transformers import AutoProcessor

from lightning_vlm.generation.vllm_engine import vllm_inputs
from lightning_vlm.models import encoding

IMAGE = Image.new("RGB", (56, 56), (200, 30, 30))


def user(text: str, images: int) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


ANSWER = {"role": "assistant", "content": [{"type": "text", "text": "red"}]}


@pytest.fixture(scope="module")
def processor(tiny_path):
    return AutoProcessor.from_pretrained(tiny_path("qwen2_5_vl"))


def test_a_row_with_the_image_token_in_its_text_is_named(processor):
    config = type(
        "Config", (), {"image_token_id": processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")}
    )()
    good = {"messages": [user("Color?", 1), ANSWER], "images": [IMAGE]}
    assert encoding.encode_sft(processor, config, [good], "<|im_end|>")["input_ids"].shape[0] == 1
    for images in (1, 0):
        bad = {"messages": [user("<|image_pad|> What colour?", images), ANSWER], "images": [IMAGE] * images}
        match = rf"What colour\?' with {images} image.*: {images + 1} image tokens '<\|image_pad\|>' for {images} image"
        with pytest.raises(ValueError, match=match):
            encoding.encode_sft(processor, config, [good, bad], "<|im_end|>")
        with pytest.raises(ValueError, match=match):
            encoding.encode_prompts(
                processor, [good["messages"][:1], bad["messages"][:1]], [[IMAGE], bad["images"]]
            )
        with pytest.raises(ValueError, match=match):
            vllm_inputs(processor, bad["messages"][:1], bad["images"])
