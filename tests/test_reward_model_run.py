"""A sequence-classification reward model as the only reward of a GRPO run built from the configs
(``method.reward_model``, ``method.reward_funcs=[]``): the run's rewards and advantages are the reward
model's scores of the completions it sampled."""

from __future__ import annotations

import pytest
import torch
from hand_helpers import group_advantages_by_hand

from helpers import compose_train
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.models.vlm import VLM
from lightning_vlm.rewards import RewardModel
from lightning_vlm.training import train

G = 4


@pytest.fixture(scope="module")
def reward_model_dir(tiny_path, tmp_path_factory):
    """A random Qwen2 reward model (one score) reading the tiny VLM's tokenizer and chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_path("qwen2_5_vl"))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(50)  # random init gives near-zero scores; make texts score visibly apart
    out = tmp_path_factory.mktemp("rm") / "tiny_rm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def score_by_hand(folder, prompt: list[dict], completion: str) -> float:
    """The model's logit for the chat-templated text of prompt (image blocks dropped) + completion."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    messages = [{"role": m["role"], "content": "".join(b["text"] for b in m["content"] if b["type"] == "text")}
                for m in prompt] + [{"role": "assistant", "content": completion}]  # fmt: skip
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False,
                    return_tensors="pt")["input_ids"]  # fmt: skip
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_reward_model_scores_are_the_runs_rewards(tiny_path, reward_model_dir, tmp_path, monkeypatch):
    sampled = []
    generate = HFGenerator.generate

    def recording(self, rows, num_generations, sampling):
        rollouts = generate(self, rows, num_generations, sampling)
        sampled.append(rollouts)
        return rollouts

    monkeypatch.setattr(HFGenerator, "generate", recording)
    rm_node = f"{{_target_:lightning_vlm.rewards.RewardModel,model_name_or_path:{reward_model_dir}}}"
    cfg = compose_train(
        ["method=grpo", f"model.model_name_or_path={tiny_path('qwen2_5_vl')}", "method.reward_funcs=[]",
         f"method.reward_model={rm_node}", f"method.num_generations={G}", "data.batch_size=2",
         "logger=none", "callbacks=none", "trainer.max_steps=1", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false"],
        tmp_path,
    )  # fmt: skip
    before = dict(VLM(tiny_path("qwen2_5_vl")).named_parameters())
    metrics, out = train(cfg)
    module = out["module"]
    assert isinstance(module.reward_model, RewardModel) and list(module.scorer.names) == ["tiny_rm"]

    # The reward model's scores of what the run sampled, by a plain forward of each text-only conversation.
    (rollouts,) = sampled
    scores = [score_by_hand(reward_model_dir, rollouts.rows[p]["prompt"], text)
              for p, text in zip(rollouts.prompt_index, rollouts.completion_texts, strict=True)]  # fmt: skip
    assert len(set(scores)) == len(scores), "scores must tell the completions apart"
    expected = torch.tensor(scores, dtype=torch.float64)
    assert metrics["train/rewards/tiny_rm/mean"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert metrics["train/reward"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert metrics["train/reward_std"] == pytest.approx(expected.std().item(), rel=1e-4)
    # ... and they are what the policy gradient follows: the advantages are theirs, and the weights moved.
    adv = group_advantages_by_hand(scores, G)
    assert metrics["train/advantages/abs_mean"] == pytest.approx(adv.abs().mean().item(), rel=1e-4)
    assert metrics["train/frac_reward_zero_std"] == 0.0
    moved = max((p - before[n]).abs().max().item() for n, p in module.vlm.named_parameters())
    assert moved > 0
