"""What SFT trains on, row shape by row shape, on every tiny family: the labelled text of each row.

A prompt-completion row trains on its completion only (TRL's completion_only_loss), also when its
prompt holds assistant turns; a conversation may open with the assistant; an image inside an answer
is not trained on as text; a template that rewrites earlier turns fails naming the row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from _chat_templates import LLAVA_1_5, SYSTEM_AS_IS
from PIL import Image

from lightning_vlm.data.rows import normalize_row
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import VLM


def _user(text: str, image: bool = False) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * image + [{"type": "text", "text": text}]}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@contextlib.contextmanager
def chat_template(vlm: VLM, template: str) -> Iterator[None]:
    """``vlm``'s processor renders with ``template`` inside the block (the module shares its VLMs)."""
    saved, vlm.processor.chat_template = vlm.processor.chat_template, template
    try:
        yield
    finally:
        vlm.processor.chat_template = saved


def labelled(vlm: VLM, row: dict) -> list[str]:
    """The labelled runs of one row's tokens, decoded."""
    batch = vlm.encode_sft([row])
    runs, current = [], []
    for token, label in zip(batch["input_ids"][0].tolist(), batch["labels"][0].tolist(), strict=True):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs += [current] if current else []
    return [vlm.tokenizer.decode(run) for run in runs]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_prompt_completion_row_trains_on_its_completion_only(vlms, family):
    # The prompt's assistant turn ("I am not sure.") was trained on too: the row became one conversation.
    vlm, image = vlms(family), Image.new("RGB", (56, 56), (200, 30, 30))
    prompt = [_user("What colour?", image=True), _assistant("I am not sure."), _user("Look again.")]
    row = normalize_row({"prompt": prompt, "completion": [_assistant("red")], "images": [image]}, "sft")
    whole = normalize_row({"messages": [*prompt, _assistant("red")], "images": [image]}, "sft")
    trained, conversation = labelled(vlm, row), labelled(vlm, whole)
    assert len(conversation) == 2 and trained == conversation[1:]
    assert "red" in trained[0] and vlm.end_of_turn in trained[0]
    # A completion without an answer is refused, though the prompt holds one.
    with pytest.raises(ValueError, match="nothing to train on"):
        normalize_row({"prompt": prompt, "completion": [_assistant(" ")], "images": [image]}, "sft")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_conversation_may_open_with_the_assistant(vlms, family):
    # The template got an empty conversation for the greeting's prefix: IndexError inside transformers.
    vlm = vlms(family)
    messages = [_assistant("Hi! Send a question."), _user("Colour?"), _assistant("red")]
    runs = labelled(vlm, normalize_row({"messages": messages}, "sft"))
    assert [r.replace(vlm.end_of_turn, "").strip() for r in runs] == ["Hi! Send a question.", "red"]


def test_an_image_inside_an_answer_is_not_trained_on_as_text(vlms):
    vlm = vlms("qwen2_5_vl")
    answer = {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image"}]}
    row = normalize_row(
        {"messages": [_user("Show it."), answer], "images": [Image.new("RGB", (56, 56))]}, "sft"
    )
    batch = vlm.encode_sft([row])
    labels = batch["labels"][0]
    assert not torch.isin(labels, torch.tensor(vlm.suppressed_token_ids)).any()
    assert "Here:" in vlm.tokenizer.decode(labels[labels != -100])


def test_a_template_that_rewrites_earlier_turns_names_the_row(vlms):
    vlm = vlms("qwen2_5_vl")
    # Keeps only the last assistant turn's text (as thinking templates drop earlier reasoning).
    with chat_template(
        vlm,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
        "...{% else %}{{ m.content if m.content is string else m.content[0].text }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ):
        row = normalize_row(
            {"messages": [_user("Colour?"), _assistant("red"), _user("Sure?"), _assistant("yes")]}, "sft"
        )
        with pytest.raises(
            ValueError, match=r"SFT row 'Colour\?.*with 0 images: the chat template .* single-turn"
        ):
            vlm.encode_sft([row])


def test_a_template_that_prints_the_system_content_as_it_is_gets_the_text(vlms):
    # Gemma 4's template trims messages[0]['content']: rows hold blocks, so every system prompt was the
    # Python repr "[{'type': 'text', 'text': 'Be brief.'}]", in SFT, preference and generation prompts.
    from lightning_vlm.generation.vllm_engine import vllm_inputs

    vlm = vlms("qwen2_5_vl")
    with chat_template(vlm, SYSTEM_AS_IS):
        messages = [{"role": "system", "content": "Be brief."}, _user("Colour?"), _assistant("red")]
        row = normalize_row({"messages": messages}, "sft")
        assert isinstance(row["messages"][0]["content"], list)  # rows keep blocks
        sft = vlm.tokenizer.decode(vlm.encode_sft([row])["input_ids"][0])
        prompt = vlm.tokenizer.decode(vlm.encode_prompts([row["messages"][:2]])["input_ids"][0])
        engine = vllm_inputs(vlm.processor, row["messages"][:2], [])["prompt"]
        for text in (sft, prompt, engine):
            assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "'type'" not in text
        assert labelled(vlm, row) == ["red<|im_end|>"]
    # A template that reads the blocks (the tiny Qwen's) still gets them.
    assert "system\nBe brief." in vlm.tokenizer.decode(vlm.encode_sft([row])["input_ids"][0])


def test_a_generation_prompt_prefill_is_prompt_in_sft_and_preference_rows(vlms):
    # Gemma 4 12B/26B/31B prefill an empty thought channel in the generation prompt, which a finished turn
    # lacks: every SFT and DPO row failed the prefix check. The answer follows the prefill, as in generation.
    from lightning_vlm.methods.preference_batch import answer_ids
    from lightning_vlm.models.tiny_templates import GEMMA4_TEMPLATE

    vlm, prefill = vlms("gemma4"), "<|channel>thought\n<channel|>"
    template = GEMMA4_TEMPLATE.replace(
        "'<|turn>model\\n' -}}{%- endif", "'<|turn>model\\n<|channel>thought\\n<channel|>' -}}{%- endif"
    )
    assert template != GEMMA4_TEMPLATE
    with chat_template(vlm, template):
        prompt = [_user("Colour?")]
        row = normalize_row({"messages": [*prompt, _assistant("red")]}, "sft")
        batch = vlm.encode_sft([row])
        head = vlm.encode_prompts([prompt])["input_ids"][0].tolist()
        ids = batch["input_ids"][0].tolist()
        assert ids[: len(head)] == head and vlm.tokenizer.decode(head).endswith(prefill)
        assert labelled(vlm, row) == ["red<turn|>"]
        # The preference answer is the same tokens after the same prompt.
        answer = answer_ids(vlm, prompt, [_assistant("red")], "test")
        assert (
            head + answer == ids[: len(head) + len(answer)] and vlm.tokenizer.decode(answer) == "red<turn|>"
        )
        # Every trained turn follows the prefill; one opening the conversation too.
        messages = [_assistant("Hi!"), _user("Colour?"), _assistant("red"), _user("Sure?"), _assistant("yes")]
        conversation = normalize_row({"messages": messages}, "sft")
        assert labelled(vlm, conversation) == ["Hi!<turn|>", "red<turn|>", "yes<turn|>"]
        text = vlm.tokenizer.decode(vlm.encode_sft([conversation])["input_ids"][0])
        assert text.count(f"<|turn>model\n{prefill}") == 3


def test_a_template_that_closes_no_answer_gets_the_end_of_turn_after_each_trained_answer(vlms, caplog):
    # LLaVA-1.5's template ends an answer with a space: SFT never taught the model to stop, and preference
    # answers lacked the token generation ends with.
    from lightning_vlm.methods.preference_batch import answer_ids
    from lightning_vlm.models.encoding import render

    vlm, image = vlms("llava"), Image.new("RGB", (56, 56), (200, 30, 30))
    eot = vlm.end_of_turn
    with chat_template(vlm, LLAVA_1_5):
        prompt = [_user("Colour?", image=True)]
        row = normalize_row({"messages": [*prompt, _assistant("red")], "images": [image]}, "sft")
        assert eot not in render(vlm.processor, row["messages"])
        assert [run.strip() for run in labelled(vlm, row)] == [f"red{eot}"]  # as LLaVA: no space before it
        ids = vlm.encode_sft([row])["input_ids"][0].tolist()
        head = vlm.encode_prompts([prompt], [[image]])["input_ids"][0].tolist()
        answer = answer_ids(vlm, prompt, row["messages"][1:], "test")  # rows hold blocks
        assert (
            ids[: len(head) + len(answer)] == head + answer
            and vlm.tokenizer.decode(answer).strip() == f"red{eot}"
        )
        messages = [_user("Colour?"), _assistant("red"), _user("Sure?"), _assistant("yes")]
        runs = labelled(vlm, normalize_row({"messages": messages}, "sft"))
        assert [run.strip() for run in runs] == [f"red{eot}", f"yes{eot}"]
    assert sum("closes an assistant answer with no" in r.message for r in caplog.records) == 1  # said once


def test_glm_answers_end_with_the_user_token_that_opens_the_next_turn_never_twice(vlms, caplog):
    # GLM-4.1V's template closes no turn: its models end an answer with "<|user|>" (one of the ids their
    # generation config stops at), as GLM's fine-tuning trains them. A last answer gets it put after; an
    # answer followed by a turn is trained up to that turn's own "<|user|>", which is not doubled.
    from lightning_vlm.methods.preference_batch import answer_ids

    vlm = vlms("glm4v")
    assert vlm.end_of_turn == "<|user|>" and vlm.end_of_turn_id not in vlm.suppressed_token_ids
    messages = [_user("Colour?"), _assistant("red"), _user("Sure?"), _assistant("yes")]
    row = normalize_row({"messages": messages}, "sft")
    assert labelled(vlm, row) == ["red<|user|>", "yes<|user|>"]
    text = vlm.tokenizer.decode(vlm.encode_sft([row])["input_ids"][0])
    assert text.endswith("<|assistant|>\nred<|user|>\nSure?<|assistant|>\nyes<|user|>"), text
    # The answer a preference method scores is the same tokens, as generation ends it.
    answer = answer_ids(vlm, row["messages"][:1], row["messages"][1:2], "test")
    assert vlm.tokenizer.decode(answer) == "red<|user|>"
    # An answer before a system turn is trained as rendered: no empty user turn is invented for it.
    messages = [
        _user("Colour?"),
        _assistant("red"),
        {"role": "system", "content": "Be brief."},
        *messages[2:],
    ]
    row = normalize_row({"messages": messages}, "sft")
    assert labelled(vlm, row) == ["red", "yes<|user|>"]
    text = vlm.tokenizer.decode(vlm.encode_sft([row])["input_ids"][0])
    assert "red<|system|>\nBe brief.<|user|>\nSure?" in text, text
    assert not [r for r in caplog.records if "closes an assistant answer with no" in r.message]


def test_a_thinking_prefill_is_the_answers_own_start_not_inserted(vlms):
    # QwQ-style: the generation prompt ends with "<think>\n", which a row's answer carries itself with its
    # reasoning. Taken for Gemma's empty channel, it was put before the answer again: "<think>" twice.
    from lightning_vlm.methods.preference_batch import answer_ids
    from lightning_vlm.models.tiny_templates import QWEN_TEMPLATE

    vlm = vlms("qwen2_5_vl")
    template = QWEN_TEMPLATE.replace(
        "'<|im_start|>assistant\\n' -}}{%- endif", "'<|im_start|>assistant\\n<think>\\n' -}}{%- endif"
    )
    assert template != QWEN_TEMPLATE
    with chat_template(vlm, template):
        prompt, answer = [_user("Colour?")], [_assistant("<think>\nshape is red\n</think>\n\nred")]
        tail = vlm.tokenizer.decode(answer_ids(vlm, prompt, answer, "test"))
        assert tail == "shape is red\n</think>\n\nred<|im_end|>"
        row = normalize_row({"messages": [*prompt, *answer]}, "sft")
        assert labelled(vlm, row) == ["shape is red\n</think>\n\nred<|im_end|>"]
        assert vlm.tokenizer.decode(vlm.encode_sft([row])["input_ids"][0]).count("<think>") == 1


def test_a_max_length_that_cuts_a_whole_answer_says_so(vlms, caplog):
    # The prompt reaches max_length: the row kept its place in the batch and trained on nothing, silently.
    import logging

    from lightning_vlm.data.synthetic import synthetic_rows
    from lightning_vlm.recurring import reset_recurring

    reset_recurring()  # said at batches 1, 2, 4, ...: other tests' batches count too
    vlm = vlms("qwen2_5_vl")
    rows = synthetic_rows("sft", 2, seed=0)
    full = vlm.encode_sft(rows)
    first_labels = [int((labels != -100).nonzero()[0]) for labels in full["labels"]]
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.models.encoding"):
        cut = vlm.encode_sft(rows, max_length=min(first_labels))
    assert (cut["labels"] == -100).all()
    assert any("max_length=" in r.getMessage() and "2 rows" in r.getMessage() and "method.max_length"
               in r.getMessage() for r in caplog.records)  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.models.encoding"):
        vlm.encode_sft(rows, max_length=max(first_labels) + 1)  # an answer token left in each: no warning
    assert not caplog.records


def test_a_turn_with_loss_false_is_not_trained_on(vlms):
    # ms-swift's per-turn flag: "loss": false was kept as an unknown key and the turn trained on
    vlm = vlms("qwen2_5_vl")
    skipped = {**_assistant("IGNOREME"), "loss": False}
    messages = [_user("Hello"), skipped, _user("What colour?"), {**_assistant("red"), "loss": True}]
    row = normalize_row({"messages": messages}, "sft")
    assert labelled(vlm, row) == ["red<|im_end|>"]
    from lightning_vlm.data.row_error import RowError

    with pytest.raises(RowError, match=r"message 1 has 'loss': 'no'; expected true or false"):
        normalize_row({"messages": [_user("Hi"), {**_assistant("Yo"), "loss": "no"}]}, "sft")
    with pytest.raises(RowError, match=r"no_answer"):
        normalize_row({"messages": [_user("Hi"), skipped]}, "sft")
