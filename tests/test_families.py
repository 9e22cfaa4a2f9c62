"""Per-family tests generated from the registry: every record has its tiny model and YAMLs, names its
layers and special tokens rightly, scores mixed and multi-image batches row for row as alone (the
DPO pair batch and the online G-group batch, one vision pass), and runs 2 steps of GRPO and DPO.

HF = vLLM greedy parity (1, 3 and 0 images) is in test_tiny_zoo.py; SFT and prompt-completion
batches with text-only and multi-image rows, left and right padding, and LoRA in test_vlm.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from helpers import CONF, TowerCounter, compose_train, mixed_rows
from lightning_vlm.methods.preference_batch import answer_ids, encode_pairs
from lightning_vlm.models.families import FAMILIES, family_of
from lightning_vlm.models.image_tokens import repeat_samples
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.tiny_recipes import RECIPES
from lightning_vlm.models.vision_cache import repeated_groups, with_image_groups
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.fsdp import layer_classes
from lightning_vlm.training import train

# Registered families without a tiny model: the same layout and rules as one that has one.
HUB_ONLY = {"smolvlm": "idefics3"}
# Processor settings of hub checkpoints the tiny defaults leave off: SmolVLM splits each image into
# sub-images (here 2x2 + the whole one), so a sample's vision features outnumber its images.
VARIANTS = {"split": {"do_image_splitting": True, "size": {"longest_edge": 112}}}
MIXED_CASES = [*TINY_FAMILIES, "idefics3:split"]
# Families whose chat template prints an assistant turn's content as text (GLM-4.1V's checkpoints).
USER_TURN_IMAGES_ONLY = {"glm4v"}


@pytest.fixture(scope="module")
def vlms(tiny_path):
    cache: dict[str, VLM] = {}

    def get(case: str) -> VLM:
        if case not in cache:
            family, _, variant = case.partition(":")
            torch.manual_seed(0)
            cache[case] = VLM(tiny_path(family), processor_kwargs=VARIANTS.get(variant)).eval()
        return cache[case]

    return get


def test_every_family_has_a_record_a_tiny_model_and_model_yamls():
    assert set(TINY_FAMILIES) == set(RECIPES)
    for family in TINY_FAMILIES:
        assert RECIPES[family].model_type in FAMILIES, family
        assert (CONF / "model" / f"tiny_{family}.yaml").is_file(), family
    assert set(FAMILIES) == set(TINY_FAMILIES) | set(HUB_ONLY)
    hub = {p.stem for p in (CONF / "model").glob("*.yaml")}
    for family in ("qwen3_vl", "qwen3_5", "gemma4", "internvl", "glm4v"):
        assert family in hub, family


def test_an_unknown_family_is_a_hard_error_saying_how_to_add_one():
    with pytest.raises(
        ValueError, match=r"'gpt2' is not a supported VLM family: add a Family record .*families\.py"
    ):
        family_of("gpt2")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_layer_classes_and_suppressed_tokens_come_from_the_record(vlms, family):
    vlm = vlms(family)
    names = {c.__name__ for c in layer_classes(vlm.model)}
    assert type(vlm.language_model.layers[0]).__name__ in names
    assert names - {type(vlm.language_model.layers[0]).__name__}, "a vision block is wrapped too"
    # Every named marker of the recipe's tokenizer is never sampled; eos, pad and bos may be.
    recipe = RECIPES[family]
    sampleable = {"eos_token", "pad_token", "bos_token"}
    markers = [t for name, t in recipe.special.items() if name not in sampleable]
    vocab = vlm.tokenizer.get_vocab()
    assert markers and {vocab[t] for t in markers} <= set(vlm.suppressed_token_ids), markers
    assert vlm.end_of_turn_id not in vlm.suppressed_token_ids


@pytest.mark.parametrize("family", MIXED_CASES)
def test_dpo_pairs_of_a_mixed_batch_score_as_each_row_alone(vlms, family):
    vlm = vlms(family)
    rows = mixed_rows("preference")
    batch = encode_pairs(vlm, rows)
    with torch.no_grad(), TowerCounter(vlm.vision_tower) as tower:
        logps, _ = vlm.token_logps(batch.inputs, batch.completion_mask)
        for i, row in enumerate(rows):
            alone = encode_pairs(vlm, [row])
            solo, _ = vlm.token_logps(alone.inputs, alone.completion_mask)
            for j in range(2):
                got = logps[2 * i + j][batch.completion_mask[2 * i + j]]
                torch.testing.assert_close(got, solo[j][alone.completion_mask[j]], atol=1e-5, rtol=0)
    # One vision pass for the mixed batch (chosen and rejected share it), one per row alone with images.
    assert tower.calls == 1 + 2


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_sft_tokenises_prompt_and_answer_apart_as_dpo_and_generation_do(vlms, family):
    # An answer starting with whitespace merged with the generation prompt's last character into one
    # token (Gemma 3: "model\n" + "\n\nred" -> "\n\n\n"), which SFT labelled and generation never makes.
    vlm = vlms(family)
    image = Image.new("RGB", (56, 56), "red")

    def user(q: str, with_image: bool = False) -> dict:
        return {
            "role": "user",
            "content": [*([{"type": "image"}] if with_image else []), {"type": "text", "text": q}],
        }

    def assistant(a: str) -> dict:
        return {"role": "assistant", "content": [{"type": "text", "text": a}]}

    turns = [[user("What colour?", True), assistant(a)] for a in ("\n\nred", "red", " red")]
    turns.append([user("What colour?", True), assistant("blue"), user("And now?"), assistant("\n\ngreen")])
    batch = vlm.encode_sft([{"messages": m, "images": [image]} for m in turns])
    for b, messages in enumerate(turns):
        labelled = batch["input_ids"][b][batch["labels"][b] != -100].tolist()
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        expected = [t for i in answers for t in answer_ids(vlm, messages[:i], messages[i : i + 1], "test")]
        assert labelled == expected, (b, labelled, expected)
        prompt = vlm.encode_prompts([messages[: answers[0]]], [[image]])["input_ids"][0].tolist()
        whole = prompt + answer_ids(
            vlm, messages[: answers[0]], messages[answers[0] : answers[0] + 1], "test"
        )
        assert batch["input_ids"][b][: len(whole)].tolist() == whole, b
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    # An answer that starts with an image: Gemma 3 wraps it in "\n\n", which merges with the prompt's
    # "\n" inside the expanded placeholder; that token is left whole (splitting it invented '<', 's').
    messages = [
        user("What colour?"),
        {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "red"}]},
    ]
    if family in USER_TURN_IMAGES_ONLY:
        with pytest.raises(
            ValueError, match=r"prints assistant turns' content as text, so their image blocks"
        ):
            vlm.encode_sft([{"messages": messages, "images": [image]}])
        return
    image_first = vlm.encode_sft([{"messages": messages, "images": [image]}])
    text = vlm.processor.apply_chat_template(messages, tokenize=False)
    raw = vlm.processor(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    assert image_first["input_ids"][0].tolist() == raw["input_ids"][0].tolist()


@pytest.mark.parametrize("family", MIXED_CASES)
def test_online_groups_of_a_mixed_batch_score_as_each_row_alone(vlms, family):
    vlm = vlms(family)
    rows = mixed_rows("prompt")
    prompts = vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])
    groups = 2
    completions = [[40 + i, 41 + i, vlm.end_of_turn_id] for i in range(len(rows) * groups)]
    completions = [[t if t not in vlm.suppressed_token_ids else 60 for t in c] for c in completions]
    inputs = vlm.encode_prompt_completion(repeat_samples(prompts, groups, vlm.config), completions)
    shared = with_image_groups(inputs, repeated_groups(len(rows), groups))
    mask = inputs["completion_mask"].bool()
    with torch.no_grad():
        with TowerCounter(vlm.vision_tower) as tower:
            batched, _ = vlm.token_logps(shared, mask)
        naive, _ = vlm.token_logps(inputs, mask)
        torch.testing.assert_close(batched, naive, atol=1e-5, rtol=0)
        for b in range(len(completions)):
            alone = vlm.encode_prompt_completion([rows[b // groups]], [completions[b]])
            solo, _ = vlm.token_logps(alone, alone["completion_mask"].bool())
            got = batched[b][mask[b]]
            torch.testing.assert_close(got, solo[0][alone["completion_mask"][0].bool()], atol=1e-5, rtol=0)
    assert tower.calls == 1


_RUN = [
    "tiny_start=random", "logger=none", "callbacks=none", "trainer.max_steps=2", "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false", "data.batch_size=2",
]  # fmt: skip


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("method", ["grpo", "dpo"])
def test_two_steps_of_grpo_and_dpo_run(family, method, tmp_path):
    extra = ["method.num_generations=2"] if method == "grpo" else []
    cfg = compose_train([f"method={method}", f"model=tiny_{family}", *_RUN, *extra], tmp_path)
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 2
    assert math.isfinite(metrics["train/loss"]), metrics
