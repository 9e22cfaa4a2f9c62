"""HF generation: shapes, end-of-turn handling, suppressed vision tokens, greedy determinism."""

from __future__ import annotations

import pytest
import torch

from helpers import TowerCounter
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.generation.base import Generator, SamplingSettings, cut_at_eos
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.models.image_tokens import repeat_samples
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import PRIVATE_KEYS, VLM

FAMILIES = ("qwen2_5_vl", "gemma3")


def test_cut_at_eos_keeps_eos_and_flags_truncation():
    assert cut_at_eos([4, 5, 9, 1, 1], {9}) == ([4, 5, 9], False)
    assert cut_at_eos([4, 5, 6], {9}) == ([4, 5, 6], True)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_shapes_grouping_and_no_vision_tokens(vlms, family):
    vlm = vlms(family)
    generator = HFGenerator(vlm)
    assert isinstance(generator, Generator)
    rows = synthetic_rows("prompt", 3)
    torch.manual_seed(0)
    hot = SamplingSettings(max_new_tokens=12, temperature=5.0)
    rollouts = generator.generate(rows, num_generations=4, sampling=hot)
    assert len(rollouts) == 12 and rollouts.prompt_index == [i // 4 for i in range(12)]
    assert len(rollouts.completion_texts) == len(rollouts.truncated) == len(rollouts.logprobs) == 12
    suppressed = set(vlm.suppressed_token_ids)
    assert suppressed and vlm.config.image_token_id in suppressed
    for ids, cut, logps in zip(rollouts.completion_ids, rollouts.truncated, rollouts.logprobs, strict=True):
        assert not suppressed & set(ids)
        assert len(logps) == len(ids)
        assert (ids[-1] != vlm.end_of_turn_id and len(ids) == 12) if cut else ids[-1] == vlm.end_of_turn_id
        assert vlm.end_of_turn_id not in ids[:-1]
    torch.manual_seed(0)
    again = generator.generate(rows, num_generations=4, sampling=hot)
    assert again.completion_ids == rollouts.completion_ids, "deterministic given the torch seed"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_deterministic_and_equals_plain_generate(vlms, family):
    vlm = vlms(family)
    generator = HFGenerator(vlm)
    rows = synthetic_rows("prompt", 2)
    rows[1]["images"] = [rows[1]["images"][0].resize((84, 140))]
    greedy = SamplingSettings(max_new_tokens=10, temperature=0.0)
    one = generator.generate(rows, num_generations=1, sampling=greedy)
    two = generator.generate(rows, num_generations=2, sampling=greedy)
    # Repeated prompts share their images correctly: each copy decodes like the original.
    assert two.completion_ids == [ids for ids in one.completion_ids for _ in range(2)]
    inputs = vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])
    with torch.no_grad():
        plain = vlm.model.generate(
            **{k: v for k, v in inputs.items() if k not in PRIVATE_KEYS},
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=vlm.end_of_turn_id,
            pad_token_id=vlm.pad_token_id,
            suppress_tokens=vlm.suppressed_token_ids,
        )
    new = plain[:, inputs["input_ids"].shape[1] :].tolist()
    expected = [cut_at_eos(ids, {vlm.end_of_turn_id})[0] for ids in new]
    assert one.completion_ids == expected


def test_end_of_turn_stops_generation(tiny_path):
    vlm = VLM(tiny_path("qwen2_5_vl"))

    def favour_end_of_turn(module, args, logits):  # make it overwhelmingly likely
        logits[..., vlm.end_of_turn_id] += 100.0
        return logits

    vlm.lm_head.register_forward_hook(favour_end_of_turn)
    rollouts = HFGenerator(vlm).generate(synthetic_rows("prompt", 2), 2, SamplingSettings(max_new_tokens=8))
    assert rollouts.completion_ids == [[vlm.end_of_turn_id]] * 4
    assert rollouts.truncated == [False] * 4 and rollouts.completion_texts == [""] * 4


# What a checkpoint's generation_config.json may hold: Qwen2.5-VL-Instruct's own (near-greedy), and
# fields transformers would fill into any our config leaves unset.
CHECKPOINT_DEFAULTS = {"temperature": 0.1, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05,
                       "min_p": 0.3, "typical_p": 0.5, "no_repeat_ngram_size": 1, "min_new_tokens": 4}  # fmt: skip


@pytest.mark.parametrize("checkpoint_defaults", [False, True], ids=["plain", "checkpoint-defaults"])
def test_training_logps_match_sampler_logps(vlms, tiny_path, checkpoint_defaults):
    # The sampler draws from what training computes log-probs of, whatever the checkpoint's defaults
    # (HF generation counts as the policy: no importance-sampling correction would catch a difference).
    vlm = vlms("qwen2_5_vl")
    if checkpoint_defaults:
        vlm = VLM(tiny_path("qwen2_5_vl"))
        vlm.model.generation_config.update(**CHECKPOINT_DEFAULTS)
    rows = synthetic_rows("prompt", 2)
    torch.manual_seed(1)
    settings = SamplingSettings(max_new_tokens=6, temperature=1.5)
    rollouts = HFGenerator(vlm).generate(rows, num_generations=2, sampling=settings)
    prompts = repeat_samples(
        vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows]), 2, vlm.config
    )
    inputs = vlm.encode_prompt_completion(prompts, rollouts.completion_ids)
    with torch.no_grad():
        logps, _ = vlm.token_logps(inputs, inputs["completion_mask"].bool(), 1.5, mask_suppressed=True)
    for b, sampled in enumerate(rollouts.logprobs):
        got = logps[b][inputs["completion_mask"][b].bool()].tolist()
        assert got == pytest.approx(sampled, abs=1e-4)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_g_samples_share_the_prompt_images_and_equal_the_repeated_batch(tiny_path, family):
    """One vision pass per prompt image while sampling G completions, with the same samples as G copies."""
    vlm = VLM(tiny_path(family))
    rows = synthetic_rows("prompt", 2, seed=3)
    rows[1]["images"] = [rows[1]["images"][0].resize((84, 140))]
    hot = SamplingSettings(max_new_tokens=6, temperature=3.0)
    generator = HFGenerator(vlm)
    inputs = vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])
    with TowerCounter(vlm.vision_tower) as once:
        vlm.hidden_states(inputs)
    torch.manual_seed(0)
    with TowerCounter(vlm.vision_tower) as shared:
        rollouts = generator.generate(rows, num_generations=3, sampling=hot)
    # The naive way: every prompt repeated G times before generate, its images encoded G times.
    repeated = repeat_samples(inputs, 3, vlm.config)
    torch.manual_seed(0)
    with TowerCounter(vlm.vision_tower) as naive, torch.no_grad():
        vlm.model.eval()
        plain = vlm.model.generate(
            **{k: v for k, v in repeated.items() if k not in PRIVATE_KEYS},
            generation_config=generator.generation_config(hot),
        ).sequences
        vlm.model.train()
    expected = [
        cut_at_eos(ids, {vlm.end_of_turn_id})[0] for ids in plain[:, inputs["input_ids"].shape[1] :].tolist()
    ]
    assert rollouts.completion_ids == expected
    assert (shared.calls, shared.units) == (1, once.units)
    assert naive.units == 3 * once.units


def test_set_seed_makes_sampling_a_function_of_the_seed_and_leaves_the_callers_rng(vlms):
    generator = HFGenerator(vlms("qwen2_5_vl"))
    rows = synthetic_rows("prompt", 3)
    hot = SamplingSettings(max_new_tokens=8, temperature=3.0)

    def draw(seed: int) -> list[list[int]]:
        generator.set_seed(seed)
        try:
            return generator.generate(rows, 2, hot).completion_ids
        finally:
            generator.set_seed(None)

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = draw(7)
    torch.manual_seed(999)  # whatever the global RNG holds, the step seed decides
    assert draw(7) == first
    assert draw(8) != first, "another step seed draws other completions"
    torch.manual_seed(123)
    draw(7)
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG is untouched"


def test_generate_leaves_a_lora_models_generation_config_as_it_was(tiny_path):
    # PEFT's generate copied the blank config hidden from the call onto the wrapped model, which kept it:
    # after the first rollout a LoRA policy's export wrote a generation_config.json without eos or pad.
    vlm = VLM(tiny_path("qwen2_5_vl"), lora={"r": 4, "lora_alpha": 8})
    vlm.hf_model.generation_config.update(temperature=0.123, do_sample=True)
    before = vlm.hf_model.generation_config.to_dict()
    HFGenerator(vlm).generate(synthetic_rows("prompt", 2), 2, SamplingSettings(max_new_tokens=3))
    assert vlm.hf_model.generation_config.to_dict() == before and before["eos_token_id"] is not None


def test_sampling_settings_take_their_length_from_the_argument_only():
    settings = SamplingSettings.of({"temperature": 0.5, "top_k": 3}, 12)
    assert (settings.max_new_tokens, settings.temperature, settings.top_k, settings.top_p) == (
        12,
        0.5,
        3,
        1.0,
    )
    # a second length setting is refused, not silently checked against the first
    with pytest.raises(ValueError, match="max_completion_length"):
        SamplingSettings.of({"max_new_tokens": 4}, 12)


def test_generation_configs_hold_no_flag_transformers_calls_invalid(vlms):
    # The greedy config set top_k=0: every validation printed "The following generation flags are not
    # valid and may be ignored: ['top_k']". strict=True raises where transformers would warn.
    generator = HFGenerator(vlms("qwen2_5_vl"))
    for sampling in (SamplingSettings(max_new_tokens=4, temperature=0.0), SamplingSettings(max_new_tokens=4)):
        generator.generation_config(sampling).validate(strict=True)
