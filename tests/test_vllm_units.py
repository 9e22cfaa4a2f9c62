"""The vLLM path's pure parts, without an engine: sampling parameters, rollout assembly, weight export
(LoRA merged beside the model, vLLM names), configs, and clear errors for bad settings."""

from __future__ import annotations

import copy
import os
import re

import lightning as L
import pytest
import torch

from lightning_vlm.generation.base import SamplingSettings
from lightning_vlm.generation.vllm_sampling import SUPPRESS_BIAS, build_rollouts, sampling_kwargs
from lightning_vlm.generation.weight_sync import policy_weights, read_weights, write_weights


class _Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def test_sampling_kwargs_match_hf_behaviour():
    hot = sampling_kwargs(SamplingSettings(max_new_tokens=5, temperature=0.7, top_k=None), 4, 9, [2, 3])
    assert hot["n"] == 4 and hot["max_tokens"] == 5 and hot["temperature"] == 0.7 and hot["top_k"] == 0
    # Stop at end-of-turn only (not the checkpoint's eos), suppress vision tokens, return chosen logps.
    assert hot["ignore_eos"] and hot["stop_token_ids"] == [9] and hot["logprobs"] == 0
    assert hot["logit_bias"] == {2: SUPPRESS_BIAS, 3: SUPPRESS_BIAS}
    greedy = sampling_kwargs(SamplingSettings(do_sample=False, temperature=0.7), 1, 9, [])
    assert greedy["temperature"] == 0.0 and greedy["logit_bias"] is None
    with pytest.raises(ValueError, match="num_generations"):
        sampling_kwargs(SamplingSettings(), 0, 9, [])


def test_greedy_groups_decode_once_and_repeat_as_hf_does():
    # vLLM refuses n > 1 with greedy ("n must be 1 when using greedy sampling"); HF decodes once and repeats.
    greedy = SamplingSettings(do_sample=False, max_new_tokens=4)
    assert (
        sampling_kwargs(greedy, 3, 9, [])["n"] == 1
        and sampling_kwargs(SamplingSettings(), 3, 9, [])["n"] == 3
    )
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    r = build_rollouts(
        rows, 3, [[1, 9], [2, 9]], [[-0.1, -0.2], [-0.3, -0.4]], 9, _Tok(), "test", greedy=True
    )
    assert (
        r.completion_ids == [[1, 9]] * 3 + [[2, 9]] * 3
        and r.logprobs == [[-0.1, -0.2]] * 3 + [[-0.3, -0.4]] * 3
    )


def test_repetition_penalty_none_is_off_for_vllm_as_for_hf():
    # The engine raised a TypeError on None, and a server would fill in the checkpoint's penalty.
    assert sampling_kwargs(SamplingSettings(repetition_penalty=None), 1, 9, [])["repetition_penalty"] == 1.0


def test_request_seeds_follow_the_step_seed_and_the_row():
    from lightning_vlm.generation.vllm_sampling import request_seeds

    # Same step seed (a resumed step): the same per-request seeds; another step: other seeds.
    assert request_seeds(5, 3, 4) == request_seeds(5, 3, 4)
    assert set(request_seeds(5, 3, 4)).isdisjoint(request_seeds(6, 3, 4))
    # vLLM seeds a request's n completions s..s+n-1: the rows' streams never overlap.
    seeds = request_seeds(5, 3, 4)
    assert [b - a for a, b in zip(seeds, seeds[1:], strict=False)] == [4, 4]
    assert request_seeds(None, 2, 4) == [None, None]


def test_every_generator_has_the_whole_generator_protocol():
    from lightning_vlm.generation.base import Generator, OwnWeightsGenerator
    from lightning_vlm.generation.hf import HFGenerator
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.generation.vllm_server import VLLMServerGenerator

    # What the loop and the callback call; the engines are not built here, so their classes are read.
    members = ("is_policy", "generate", "set_seed", "sync_weights", "sleep", "wake_up", "close")
    for cls in (HFGenerator, VLLMColocateGenerator, VLLMServerGenerator):
        assert [m for m in members if not hasattr(cls, m)] == [], cls
    assert isinstance(OwnWeightsGenerator(), Generator) is False  # no generate: not a Generator alone
    assert HFGenerator.is_policy and not VLLMColocateGenerator.is_policy and not VLLMServerGenerator.is_policy


def test_build_rollouts_cuts_at_end_of_turn_and_flags_off_policy():
    rows = [{"prompt": []}, {"prompt": []}]
    ids = [[5, 9, 7], [5, 6, 7], [9], [4, 4]]
    logps = [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-0.5], [-0.1, -0.2]]
    r = build_rollouts(rows, 2, ids, logps, 9, _Tok(), "test")
    assert r.completion_ids == [[5, 9], [5, 6, 7], [9], [4, 4]]
    assert r.truncated == [False, True, False, True]
    assert r.logprobs[0] == [-1.0, -2.0] and r.prompt_index == [0, 0, 1, 1]
    assert r.extras["is_policy"] is False
    with pytest.raises(RuntimeError, match="returned 3 completions, expected 4"):
        build_rollouts(rows, 2, ids[:3], logps[:3], 9, _Tok(), "test")
    # A 2-token budget: the unfinished ones ([5, 6, 7], [4, 4]) used it up; nothing was cut short.
    assert build_rollouts(rows, 2, ids, logps, 9, _Tok(), "test", max_new_tokens=2).truncated[1]
    # [4, 4] without end-of-turn, under a 4-token budget: the engine's max_model_len stopped it
    with pytest.raises(ValueError, match=r"stopped 2 of 4 completions after 2-3 tokens, before method\.max_"):
        build_rollouts(rows, 2, ids, logps, 9, _Tok(), "test", max_new_tokens=4)


# Adapters beyond plain linear ones: lora_bias (PEFT trains a bias in lora_B) and an embedding adapter
# (its factors in lora_embedding_A/B) were left out of the merge: vLLM sampled another policy.
LORA_KINDS = {"linear": {}, "lora_bias": {"target_modules": ["q_proj", "v_proj"], "lora_bias": True},
              "embedding": {"target_modules": ["embed_tokens", "q_proj"]}}  # fmt: skip
CASES = [
    ("qwen2_5_vl", "linear"),
    ("gemma3", "linear"),
    ("qwen2_5_vl", "lora_bias"),
    ("qwen2_5_vl", "embedding"),
]


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_lora_weights_are_merged_beside_the_model_under_checkpoint_names(tiny_path, family, kind):
    from safetensors import safe_open
    from transformers.core_model_loading import revert_weight_conversion

    from lightning_vlm.models.vlm import VLM
    from lightning_vlm.models.weight_names import hf_to_vllm_names

    def as_saved(model):
        return dict(hf_to_vllm_names(family, revert_weight_conversion(model, model.state_dict()).items()))

    vlm = VLM(tiny_path(family), lora={"r": 4, "lora_alpha": 8, "init_lora_weights": False, **LORA_KINDS[kind]},
              freeze_vision_tower=True)  # fmt: skip
    with torch.no_grad():  # trained adapters: lora_B's bias and the embedding's B start at zero
        for name, p in vlm.model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.5)
    before = {k: v.clone() for k, v in vlm.model.state_dict().items()}
    exported = dict(policy_weights(vlm))
    # The names of the saved checkpoint (what every vLLM model implementation loads).
    with safe_open(f"{tiny_path(family)}/model.safetensors", "pt") as f:
        assert set(f.keys()) <= set(exported)
    expected = as_saved(copy.deepcopy(vlm.model).merge_and_unload())
    base = as_saved(copy.deepcopy(vlm.model).unload())
    assert exported.keys() == expected.keys()
    changed = 0
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor)
        changed += not torch.equal(tensor, base[name])
    assert changed, "random adapters must change some merged weights"
    after = vlm.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items()), "the training weights must be untouched"


def test_write_and_read_weights_with_tied_tensors(tmp_path):
    w = torch.randn(4, 3)
    path = write_weights([("a.weight", w), ("b.weight", w), ("c", torch.ones(2))], tmp_path)
    assert path.name == "model.safetensors" and not list(tmp_path.glob(".tmp-*"))
    back = dict(read_weights(tmp_path))
    assert torch.equal(back["a.weight"], w) and torch.equal(back["b.weight"], w)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(read_weights(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "remote"}, "mode must be one of"),
        ({"engine": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
        ({"engine": {"tensor_parallel_size": 0}}, "tensor_parallel_size"),
        ({"engine": {"model_impl": "jax"}}, "model_impl must be one of"),
        ({"engine": {"logprobs_mode": "final"}}, "logprobs_mode must be one of"),
        ({"weight_transfer": "nfs"}, "weight_transfer must be one of"),
    ],
)
def test_callback_refuses_bad_settings_by_name(kwargs, message):
    from lightning_vlm.callbacks.vllm import VLLMGeneration

    with pytest.raises(ValueError, match=message):
        VLLMGeneration(**kwargs)


def test_callback_needs_a_module_with_a_generator():
    from lightning_vlm.callbacks.vllm import VLLMGeneration

    with pytest.raises(TypeError, match="replaceable `generator`"):
        VLLMGeneration().setup(L.Trainer(logger=False), L.LightningModule(), "fit")


@pytest.mark.parametrize("generation", ["hf", "vllm_colocate", "vllm_server"])
def test_generation_configs_compose_and_instantiate(generation, tmp_path):
    from helpers import compose_train
    from lightning_vlm.training import instantiate_group

    cfg = compose_train(["method=grpo", f"generation={generation}", "callbacks=none"], tmp_path)
    callbacks = instantiate_group(cfg.get("callbacks"))
    names = [type(c).__name__ for c in callbacks]
    assert names == ([] if generation == "hf" else ["VLLMGeneration"])
    if callbacks:
        assert callbacks[0].mode == generation.removeprefix("vllm_")
        assert callbacks[0].generator is None  # nothing is built before setup


def test_the_launcher_takes_vllms_options_with_safe_defaults(monkeypatch):
    from lightning_vlm.serve import installed_vllm_plugins, is_loopback, parse_args

    for name in ("VLLM_PLUGINS", "VLLM_SERVER_DEV_MODE", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE",
                 "VLLM_API_KEY", "LIGHTNING_VLM_MAX_REQUEST_MB"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    args = parse_args(["MODEL", "--max-num-seqs", "2"])
    assert (args.model, args.host, args.port, args.max_num_seqs) == ("MODEL", "127.0.0.1", 8000, 2)
    assert args.dtype == "float32" and args.enforce_eager and args.logprobs_mode == "processed_logprobs"
    # Ours is added to the installed plugins: a VLLM_PLUGINS with ours alone would switch the others off.
    assert os.environ["VLLM_PLUGINS"].split(",") == [*installed_vllm_plugins(), "lightning_vlm"]
    assert os.environ["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(SystemExit):  # reachable from other machines without a key
        parse_args(["MODEL", "--host", "0.0.0.0"])
    assert parse_args(["MODEL", "--host", "0.0.0.0", "--api-key", "k"]).api_key == ["k"]
    assert parse_args(["MODEL", "--host", "0.0.0.0", "--allow-remote-without-api-key"]).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        parse_args(["MODEL", "--max-request-mb", "0"])
    parse_args(["MODEL", "--max-request-mb", "3"])
    assert os.environ["LIGHTNING_VLM_MAX_REQUEST_MB"] == "3.0"
    assert (
        is_loopback("localhost")
        and is_loopback("::1")
        and not is_loopback("")
        and not is_loopback("10.0.0.1")
    )


def test_a_weight_update_is_checked_against_the_served_checkpoint(tiny_path, tmp_path):
    from safetensors.torch import save_file

    from lightning_vlm.generation.weight_sync import policy_weights, write_weights
    from lightning_vlm.models.vlm import VLM
    from lightning_vlm.serving.weights_check import UpdateRefused, check_update, read_shapes, reference_shapes

    for family in ("qwen2_5_vl", "llava"):  # llava: updates come in vLLM's names (vision_model.)
        reference = reference_shapes(tiny_path(family))
        vlm = VLM(tiny_path(family))
        check_update(read_shapes(write_weights(policy_weights(vlm), tmp_path / family).parent), reference)
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(UpdateRefused, match="wrong shape.*embed_tokens"):
        check_update(read_shapes(tmp_path), reference_shapes(tiny_path("qwen2_5_vl")))


def test_adapter_sync_needs_lora_with_everything_else_frozen(tiny_path):
    from lightning_vlm.generation.vllm_colocate import adapter_engine_options
    from lightning_vlm.models.vlm import VLM

    with pytest.raises(ValueError, match="needs a LoRA policy"):
        adapter_engine_options(VLM(tiny_path("qwen2_5_vl")))
    vlm = VLM(tiny_path("qwen2_5_vl"), lora={"r": 12}, freeze_vision_tower=True)
    assert adapter_engine_options(vlm) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1}
    next(p for n, p in vlm.model.named_parameters() if "lm_head" in n).requires_grad_(True)
    with pytest.raises(ValueError, match="lm_head.*train too"):
        adapter_engine_options(vlm)
    # all-linear reaches LLaVA's projector, whose adapter vLLM dropped: its greedy outputs differed from HF's
    llava = VLM(tiny_path("llava"), lora={"r": 8, "target_modules": "all-linear"}, freeze_vision_tower=True)
    with pytest.raises(
        ValueError, match=r"language model only, but .*multi_modal_projector.*weight_sync='merged'"
    ):
        adapter_engine_options(llava)
    assert adapter_engine_options(VLM(tiny_path("llava"), lora={"r": 8}, freeze_vision_tower=True))[
        "enable_lora"
    ]


def test_save_adapter_writes_what_peft_writes(tiny_path, tmp_path):
    from safetensors.torch import load_file

    from lightning_vlm.generation.weight_sync import save_adapter
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(tiny_path(), lora={"r": 8, "lora_alpha": 16, "init_lora_weights": False})
    vlm.model.save_pretrained(tmp_path / "peft")
    lora = {k: v for k, v in vlm.model.state_dict().items() if ".lora_" in k}
    save_adapter(vlm.model, tmp_path / "ours", lora)
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert (tmp_path / "ours" / "adapter_config.json").read_text() == (
        tmp_path / "peft" / "adapter_config.json"
    ).read_text()


def test_colocated_vllm_refuses_an_engine_core_in_another_process(monkeypatch, tiny_path):
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 in the user's environment: the engine started, and the first weight
    # sync failed ("Object of type generator is not serializable"; as a list, "cannot pickle memoryview").
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(
        ValueError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING=1 .* unset it .* generation=vllm_server"
    ):
        VLLMColocateGenerator(VLM(tiny_path("qwen2_5_vl")))


@pytest.mark.parametrize(
    ("family", "lora", "refused"),
    [
        ("gemma3", {"modules_to_save": ["lm_head"]}, "the output head (ModulesToSaveWrapper)"),
        ("gemma3", {"target_modules": ["embed_tokens", "q_proj"]}, "the input embeddings (Embedding)"),
        ("gemma3", {}, None),  # LoRA on the attention and MLP layers: head and embeddings stay one
        ("qwen2_5_vl", {"modules_to_save": ["lm_head"]}, None),  # untied: both are pushed
    ],
    ids=["tied-head-copy", "tied-embedding-lora", "tied-plain-lora", "untied-head-copy"],
)
def test_a_head_trained_apart_from_tied_embeddings_is_refused_before_vllm_starts(
    tiny_path, family, lora, refused
):
    # vLLM builds a tied checkpoint tied and skips the pushed lm_head as an alias: after one step it
    # sampled from the untrained matrix (greedy ids all 512 against HF's), silently.
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.generation.weight_sync import check_tied_head
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(tiny_path(family), lora={"r": 4, "lora_alpha": 8, **lora})
    if refused is None:
        check_tied_head(vlm)
        return
    with pytest.raises(ValueError, match=rf"gemma3 ties .* trains {re.escape(refused)} apart"):
        VLLMColocateGenerator(vlm)  # raises before the engine is built


def test_min_p_with_top_p_under_vllm_is_named(tmp_path, caplog):
    # vLLM applies min_p before top_p, HF after: p = [.5, .25, .15, .1], top_p .8, min_p .25 keeps 3 tokens
    # in HF and 2 in vLLM. A run without the correction (Online DPO) would sample otherwise, silently.
    import logging

    from helpers import compose_train
    from lightning_vlm.settings_check import check_settings

    both = ["method=online_dpo", "logger=none", "callbacks=none", "++tiny_start=random", "method.sampling.top_p=0.9",
            "method.sampling.min_p=0.1"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        check_settings(compose_train(both, tmp_path))  # HF generate: nothing to compare with
        assert "vLLM applies min_p first" not in caplog.text
        check_settings(compose_train([*both, "generation=vllm_colocate"], tmp_path))
    assert "method.sampling.top_p=0.9 with min_p=0.1: vLLM applies min_p first" in caplog.text
