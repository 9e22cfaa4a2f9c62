"""A sequence-classification reward model as a reward function: its scores match a manual forward,
ignore padding side and batching, and combine with other functions in the scorer."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.rewards import RewardFunctionError, RewardModel, RewardScorer, accuracy_reward

PROMPT = [
    {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "What color?"}]}
]


@pytest.fixture(scope="module")
def reward_model_dirs(tmp_path_factory):
    """A tiny random Qwen2 reward model + a trained tiny BPE tokenizer, saved with both padding sides."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    special = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["What color is the shape? red green blue <answer> think"] * 20, trainer=trainer)
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    # Random init gives a near-zero head; scale it so scores differ visibly between texts.
    with torch.no_grad():
        model.score.weight.mul_(50)
    root = tmp_path_factory.mktemp("reward_model")
    dirs = {}
    for side in ("right", "left"):
        wrapped = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side=side
        )
        wrapped.chat_template = template
        dirs[side] = root / side
        model.save_pretrained(dirs[side])
        wrapped.save_pretrained(dirs[side])
    two_labels = Qwen2ForSequenceClassification(Qwen2Config(**{**config.to_dict(), "num_labels": 2}))
    dirs["two_labels"] = root / "two_labels"
    two_labels.save_pretrained(dirs["two_labels"])
    wrapped.save_pretrained(dirs["two_labels"])
    return dirs


def _rm_batch():
    prompts = [
        PROMPT,
        [{"role": "user", "content": "What color is the shape?"}],
        [{"role": "system", "content": "think"}] + PROMPT,
    ]
    completions = ["red", "<answer>green</answer> because the shape is green", "blue blue"]
    return prompts, completions


def test_reward_model_matches_manual_forward_and_is_deterministic(reward_model_dirs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts, completions = _rm_batch()
    rm = RewardModel(reward_model_dirs["right"], batch_size=2)
    scores = rm(completions, prompts=prompts, solution=["red", "green", "blue"])
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert rm(completions, prompts=prompts) == scores
    assert len(set(scores)) == 3
    assert rm.__name__ == "right"

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dirs["right"])
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dirs["right"]).eval()
    for prompt, completion, score in zip(prompts, completions, scores, strict=True):
        # Text-only by hand: image blocks dropped, text blocks as the content string.
        messages = [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else "".join(b["text"] for b in m["content"] if b["type"] == "text"),
            }
            for m in prompt
        ] + [{"role": "assistant", "content": completion}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)


def test_reward_model_ignores_padding_side_and_batching(reward_model_dirs):
    prompts, completions = _rm_batch()
    right = RewardModel(reward_model_dirs["right"], batch_size=3)(completions, prompts=prompts)
    left = RewardModel(reward_model_dirs["left"], batch_size=3)(completions, prompts=prompts)
    single = RewardModel(reward_model_dirs["left"], batch_size=1)(completions, prompts=prompts)
    assert left == pytest.approx(right, abs=1e-5)
    assert single == pytest.approx(right, abs=1e-5)


def test_reward_model_without_pad_token_pads_with_eos(reward_model_dirs):
    # Llama-style checkpoints define no pad token anywhere. (Loading one from disk here is not
    # possible: AutoTokenizer resolves to Qwen2Tokenizer, which adds a default pad token.)
    prompts, completions = _rm_batch()
    rm = RewardModel(reward_model_dirs["right"], batch_size=3)
    padded = rm(completions, prompts=prompts)
    rm.tokenizer.pad_token = None
    rm.model.config.pad_token_id = None
    rm.pad_token_id = rm._pad_token_id()
    assert rm.pad_token_id == rm.tokenizer.eos_token_id
    assert rm(completions, prompts=prompts) == pytest.approx(padded, abs=1e-5)


def test_reward_model_needs_one_label(reward_model_dirs):
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel(reward_model_dirs["two_labels"])


def test_reward_model_in_a_scorer_with_truncation_and_plain_prompts(reward_model_dirs):
    prompts, completions = _rm_batch()
    rm = RewardModel(reward_model_dirs["right"], max_length=6)
    assert all(len(row) <= 6 for row in rm.tokenize(prompts, completions))
    scorer = RewardScorer([rm, accuracy_reward], weights=[0.0, 1.0])
    per_function, names = scorer(completions, {"prompts": prompts, "solution": ["red", "green", "red"]})
    assert names == ["right", "accuracy_reward"]
    assert not per_function[:, 0].isnan().any()
    # Standard (string) prompts are concatenated with the completion, no chat template.
    plain = rm(["red"], prompts=["What color? "])
    assert len(plain) == 1 and math.isfinite(plain[0])
    with pytest.raises(
        RewardFunctionError, match=r"'right' \(RewardModel\('.*right'.*needs the `prompts` column"
    ):
        scorer(completions, {"solution": ["red"] * 3})


def test_reward_model_names_turns_its_template_refuses(reward_model_dirs):
    # Gemma 2 reward models' templates raise on a system turn the policy's template accepts
    rm = RewardModel(reward_model_dirs["right"])
    refuse = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    rm.tokenizer.chat_template = refuse + rm.tokenizer.chat_template
    prompts, completions = _rm_batch()
    assert len(rm.tokenize(prompts[:2], completions[:2])) == 2
    with pytest.raises(
        ValueError, match=r"RewardModel .*right.*\(system, user, assistant\).*System role not"
    ):
        rm.tokenize(prompts, completions)
