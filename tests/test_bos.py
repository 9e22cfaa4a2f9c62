"""A tokenizer that starts every text with its BOS, behind a template that does not write it (LLaVA-1.5,
LLaVA-NeXT-Mistral): the encoded rows start with BOS, as transformers' ``apply_chat_template(tokenize=True)``
gives them, and as the models were trained. The rendered text is tokenised without special tokens (so
a template's own BOS is not doubled), which dropped it here."""

from __future__ import annotations

import pytest
from _chat_templates import LLAVA_1_5
from PIL import Image
from transformers import AutoProcessor, LlavaProcessor
from transformers.models.llama.tokenization_llama import LlamaTokenizer

from lightning_vlm.models import encoding
from lightning_vlm.models.tiny import tiny_vlm_path

WORDS = ["▁", "▁red", "▁What", "▁colour?", "USER:", "ASSISTANT:", "▁ASSISTANT:", "▁USER:"]


def llava_processor(add_bos_token: bool, template: str = LLAVA_1_5) -> LlavaProcessor:
    """The tiny LLaVA's image processor with a Llama (SentencePiece-style byte-fallback) tokenizer."""
    base = AutoProcessor.from_pretrained(str(tiny_vlm_path("llava")))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in WORDS:
        vocab[word] = len(vocab)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=add_bos_token)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"], "pad_token": "<pad>"})
    return LlavaProcessor(
        image_processor=base.image_processor, tokenizer=tokenizer, patch_size=base.patch_size,
        vision_feature_select_strategy=base.vision_feature_select_strategy,
        num_additional_image_tokens=base.num_additional_image_tokens, chat_template=template,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("add_bos_token", "template"),
    [(True, LLAVA_1_5), (False, LLAVA_1_5), (True, "{{ bos_token }}" + LLAVA_1_5)],
    ids=["tokenizer-bos", "no-bos", "template-bos"],
)
def test_rows_start_with_the_bos_transformers_would_add(add_bos_token, template):
    # template-bos: real Gemma 3's way, the template writes it and the tokenizer must not add a second
    processor = llava_processor(add_bos_token, template)
    tokenizer, image = processor.tokenizer, Image.new("RGB", (56, 56), (200, 30, 30))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    with_image = [{**prompt[0], "content": [{"type": "image", "image": image}, prompt[0]["content"][1]]}]
    expected = processor.apply_chat_template(
        with_image, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert (expected["input_ids"][0][0] == tokenizer.bos_token_id) == add_bos_token
    ours = encoding.encode_prompts(processor, [prompt], [[image]])
    assert ours["input_ids"][0].tolist() == list(expected["input_ids"][0])
    # SFT: the same start, one BOS, and only the answer trained
    answer = [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    row = {"messages": prompt + answer, "images": [image]}
    config = type("Config", (), {"image_token_index": tokenizer.convert_tokens_to_ids("<image>")})()
    sft = encoding.encode_sft(processor, config, [row], "</s>")
    ids = sft["input_ids"][0].tolist()
    assert ids[: len(expected["input_ids"][0])] == list(expected["input_ids"][0])
    assert ids.count(tokenizer.bos_token_id) == int(add_bos_token)
    trained = [i for i, label in zip(ids, sft["labels"][0].tolist(), strict=True) if label != -100]
    assert tokenizer.decode(trained).strip() == "red</s>"


def test_a_processor_that_is_its_tokenizer_is_read_alike():
    # VLM takes a processor without a .tokenizer as the tokenizer itself (processor_fingerprint too)
    from lightning_vlm.models.chat_render import adds_bos

    for add_bos_token in (True, False):
        tokenizer = llava_processor(add_bos_token).tokenizer
        tokenizer.chat_template = LLAVA_1_5
        assert adds_bos(tokenizer) == add_bos_token
