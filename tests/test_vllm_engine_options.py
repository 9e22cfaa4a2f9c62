"""The vLLM engine's settings (``EngineOptions``), without an engine: what reaches ``vllm.LLM`` in-process
and the command line of a server the callback starts, from the config and the policy."""

from __future__ import annotations

import pytest


def test_engines_take_the_policys_processor_settings_unless_given_their_own():
    # vLLM builds its processor from the checkpoint alone: the policy's processor_kwargs must reach it,
    # in-process and on the command line of a server the callback starts.
    import json

    from lightning_vlm.generation.engine_options import EngineOptions

    limits = {"max_pixels": 401408}
    engine = EngineOptions().for_policy(limits)
    assert engine.mm_processor_kwargs == limits
    args = engine.server_args()
    assert json.loads(args[args.index("--mm-processor-kwargs") + 1]) == limits
    own = EngineOptions.build({"mm_processor_kwargs": {"max_pixels": 3136}})
    assert own.for_policy(limits).mm_processor_kwargs == {"max_pixels": 3136}  # a set value is kept
    assert EngineOptions().for_policy({}) == EngineOptions()
    assert "--mm-processor-kwargs" not in EngineOptions().server_args()


def test_an_unseeded_run_builds_vllm_engines_with_a_random_seed(tmp_path):
    # seed=null (an unseeded run) failed to compose with either vLLM generation config: the engine's seed
    # was an int field, and vLLM takes only ints.
    from helpers import compose_train
    from lightning_vlm.generation.engine_options import EngineOptions

    seeds = set()
    for generation in ("vllm_colocate", "vllm_server"):
        cfg = compose_train(["method=grpo", f"generation={generation}", "seed=null"], tmp_path)
        assert cfg.callbacks.vllm_generation.engine.seed is None
        engine = EngineOptions.build(cfg.callbacks.vllm_generation.engine)
        args = engine.server_args()
        assert isinstance(engine.seed, int) and args[args.index("--seed") + 1] == str(engine.seed)
        seeds.add(engine.seed)
    assert len(seeds) == 2  # drawn afresh
    assert EngineOptions(seed=7).seed == 7


def test_engine_dicts_are_set_from_the_command_line(tmp_path):
    import json

    # Both were None-valued typed nodes, into which OmegaConf cannot merge a command-line dict
    # ('NoneType' object has no attribute 'get'): only a YAML file could set them.
    from helpers import compose_train
    from lightning_vlm.generation.engine_options import EngineOptions

    cfg = compose_train(["method=grpo", "generation=vllm_colocate",
                         "callbacks.vllm_generation.engine.mm_processor_kwargs={max_pixels:3136}",
                         "callbacks.vllm_generation.engine.limit_mm_per_prompt={image:6}"], tmp_path)  # fmt: skip
    engine = EngineOptions.build(cfg.callbacks.vllm_generation.engine)
    assert engine.mm_processor_kwargs == {"max_pixels": 3136} and engine.limit_mm_per_prompt == {"image": 6}
    nested = compose_train(["generation=vllm_colocate",
                            "callbacks.vllm_generation.engine.mm_processor_kwargs={size:{longest_edge:448}}"], tmp_path)  # fmt: skip
    options = EngineOptions.build(nested.callbacks.vllm_generation.engine)
    assert type(options.mm_processor_kwargs["size"]) is dict  # a DictConfig broke the server's JSON
    args = options.server_args()
    assert json.loads(args[args.index("--mm-processor-kwargs") + 1]) == {"size": {"longest_edge": 448}}
    unset = EngineOptions.build(
        compose_train(["generation=vllm_colocate"], tmp_path).callbacks.vllm_generation.engine
    )
    assert unset.for_policy({"max_pixels": 401408}).mm_processor_kwargs == {"max_pixels": 401408}


def test_engine_max_model_len_is_the_models_own_on_gpu_and_a_measured_cap_on_cpu(monkeypatch, tmp_path):
    # A fixed 1024 for every model cut Qwen2.5-VL prompts (512 tokens per image) plus 512 completion
    # tokens. Unset, the GPU engine takes the model's context length (vLLM's and TRL's default).
    import vllm

    from lightning_vlm.generation import vllm_engine
    from lightning_vlm.generation.engine_options import EngineOptions

    built, model = [], tmp_path / "absent"  # no config to read: the CPU dtype falls back to float32
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: built.append(kwargs))
    for cuda in (True, False):
        monkeypatch.setattr(vllm_engine, "has_cuda", lambda cuda=cuda: cuda)
        vllm_engine.make_vllm_engine(model)
        vllm_engine.make_vllm_engine(model, EngineOptions(max_model_len=4096))
    gpu, gpu_set, cpu, cpu_set = built
    assert gpu["max_model_len"] is None and gpu_set["max_model_len"] == 4096
    assert cpu["max_model_len"] == cpu["max_num_batched_tokens"] == vllm_engine.CPU_MAX_MODEL_LEN
    assert cpu_set["max_model_len"] == cpu_set["max_num_batched_tokens"] == 4096
    assert "--max-model-len" not in EngineOptions().server_args()  # a started server: its own default
    args = EngineOptions(max_model_len=4096).server_args()
    assert args[args.index("--max-model-len") + 1] == "4096"


def test_the_processed_image_cache_is_off_unless_asked_for(monkeypatch, tmp_path):
    # vLLM keeps 4 GiB of processed images per process by default; verl and EasyR1 turn it off for VLM
    # rollouts (host memory grew with it), and an RL prompt's image rarely comes back.
    import vllm

    from lightning_vlm.generation import vllm_engine
    from lightning_vlm.generation.engine_options import EngineOptions

    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: built.append(kwargs))
    for cuda in (True, False):
        monkeypatch.setattr(vllm_engine, "has_cuda", lambda cuda=cuda: cuda)
        vllm_engine.make_vllm_engine(tmp_path / "absent")
        vllm_engine.make_vllm_engine(tmp_path / "absent", EngineOptions(mm_processor_cache_gb=4))
    assert [kwargs["mm_processor_cache_gb"] for kwargs in built] == [0, 4, 0, 4]
    for gb, expected in ((0.0, "0.0"), (4, "4")):
        args = EngineOptions(mm_processor_cache_gb=gb).server_args()  # the server the callback starts
        assert args[args.index("--mm-processor-cache-gb") + 1] == expected
    with pytest.raises(ValueError, match="mm_processor_cache_gb must be >= 0"):
        EngineOptions(mm_processor_cache_gb=-1)
