"""A row whose turns the model's chat template refuses (real Gemma 3's, Mistral's and LLaVA-NeXT's templates
raise on turns that do not alternate user/assistant): the error names the row and its turns wherever the
row is rendered, instead of Jinja's bare ``TemplateError`` from inside a data loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoProcessor

from lightning_vlm.generation.vllm_engine import vllm_inputs
from lightning_vlm.methods.preference_batch import answer_ids
from lightning_vlm.models import encoding

# Real Gemma 3's check, ahead of the tiny model's own template.
ALTERNATE = (
    "{%- for message in messages | rejectattr('role', 'equalto', 'system') -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}{%- endfor -%}"
)


def text(role: str, words: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": words}]}


GOOD = [text("user", "What colour is the shape?")]
BAD = [text("user", "Which shape is it?"), text("user", "And its colour?")]
ANSWER = [text("assistant", "red")]
NAMED = r"Which shape is it\?.*\(user, user.*Conversation roles must alternate"


@pytest.fixture(scope="module")
def processor(tiny_path):
    processor = AutoProcessor.from_pretrained(tiny_path("qwen2_5_vl"))
    processor.chat_template = ALTERNATE + processor.chat_template
    return processor


def test_the_template_accepts_alternating_turns(processor):
    # the check is live: a good row renders, so each refusal below is the row's, not the template's
    assert "What colour is the shape?" in encoding.render(processor, GOOD + ANSWER)


def test_an_sft_row_is_named(processor):
    rows = [{"messages": GOOD + ANSWER, "images": []}, {"messages": BAD + ANSWER, "images": []}]
    with pytest.raises(ValueError, match=NAMED):
        encoding.encode_sft(processor, SimpleNamespace(image_token_id=0), rows, "<|im_end|>")


def test_a_prompt_is_named(processor):
    with pytest.raises(ValueError, match=NAMED):
        encoding.encode_prompts(processor, [GOOD, BAD], [[], []])
    with pytest.raises(ValueError, match=NAMED):
        vllm_inputs(processor, BAD, [])


def test_a_preference_answer_is_named(processor):
    vlm = SimpleNamespace(processor=processor, tokenizer=processor.tokenizer, end_of_turn="<|im_end|>")
    with pytest.raises(ValueError, match=r"row 1, 'chosen'.*\(user, user.*Conversation roles must alternate"):
        answer_ids(vlm, BAD, ANSWER, "row 1, 'chosen'")
