"""The multi-process trainer configs compose with every method and model and build the strategies they
say: DDP, FSDP (each family's decoder layers and vision blocks wrapped and checkpointed, mixed precision
from the model's scale, sharded checkpoints) and DeepSpeed ZeRO-2/3. Their runs are in test_ddp_*.py
(DDP, FSDP on CPU) and scripts/gpu_check.sh (GPU); here the objects and their settings."""

from __future__ import annotations

from types import SimpleNamespace

import hydra
import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from helpers import compose_train, group_options
from lightning_vlm.parallel.fsdp import VLMFSDPStrategy, check_orig_params, layer_classes

PARALLEL = ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"]
TINY = [m for m in group_options("model") if m.startswith("tiny_")]


def _combinations() -> list[tuple[str, str, str]]:
    # every method with the default model, and every model with GRPO (the method FSDP matters most for)
    pairs = {(m, "tiny_qwen2_5_vl") for m in group_options("method")} | {
        ("grpo", m) for m in group_options("model")
    }
    return [(t, m, model) for t in PARALLEL for m, model in sorted(pairs)]


@pytest.mark.parametrize(("trainer", "method", "model"), _combinations())
def test_parallel_trainers_compose_with_every_method_and_model(trainer, method, model, tmp_path):
    cfg = compose_train([f"trainer={trainer}", f"method={method}", f"model={model}"], tmp_path)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    expected = {"ddp": DDPStrategy, "fsdp": VLMFSDPStrategy}.get(trainer, DeepSpeedStrategy)
    assert isinstance(strategy, expected)
    # size-dependent precision still comes from the model (conf/scale), whatever the strategy
    assert cfg.trainer.precision == ("32-true" if model.startswith("tiny_") else "bf16-mixed")


def test_ddp_settings(tmp_path):
    cfg = compose_train(["trainer=ddp"], tmp_path)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert strategy._ddp_kwargs == {"find_unused_parameters": False}
    assert strategy._process_group_backend is None and strategy._timeout.total_seconds() == 1800
    assert cfg.trainer.accelerator == "auto" and cfg.trainer.devices == "auto"


def test_fsdp_settings_and_mixed_precision_of_hub_models(tmp_path):
    cfg = compose_train(["trainer=fsdp", "model=qwen2_5_vl", "method=grpo"], tmp_path)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert strategy.wrap_layers and strategy.checkpoint_layers
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == "sharded"
    assert strategy.kwargs["use_orig_params"] is True and strategy.kwargs["limit_all_gathers"] is True
    # The precision plugin Lightning pairs with it: fp32 sharded master weights, bf16 compute.
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision=cfg.trainer.precision, logger=False
    )
    mixed = trainer.strategy.mixed_precision_config
    assert mixed.param_dtype == torch.bfloat16
    # Buffers and gradient reductions stay fp32, as under DDP with autocast: Lightning's bf16 buffers put
    # RoPE's inv_freq in bf16 (rotary angles off by radians at thousands of positions).
    assert mixed.buffer_dtype == mixed.reduce_dtype == torch.float32


@pytest.mark.parametrize("model", TINY)
def test_fsdp_wraps_each_familys_decoder_layers_and_vision_blocks(model, tmp_path):
    cfg = compose_train([f"model={model}"], tmp_path)
    vlm = hydra.utils.instantiate(cfg.model)
    names = {c.__name__ for c in layer_classes(vlm)}
    assert any(n.endswith("DecoderLayer") for n in names), names
    # every decoder layer is an instance of a wrapped class: each becomes its own FSDP unit
    layers = vlm.language_model.layers
    assert all(type(layer).__name__ in names for layer in layers)


@pytest.mark.parametrize(("trainer", "stage"), [("deepspeed_zero2", 2), ("deepspeed_zero3", 3)])
def test_deepspeed_settings(trainer, stage, tmp_path):
    cfg = compose_train([f"trainer={trainer}"], tmp_path)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert cfg.trainer.accelerator == "gpu"


@pytest.mark.parametrize("trainer", ["deepspeed_zero2", "deepspeed_zero3"])
def test_an_online_method_clips_in_the_deepspeed_engine(trainer, tmp_path):
    # Lightning refuses trainer.gradient_clip_val for a module that steps its own optimizer, and
    # DeepSpeed's precision plugin does not clip: max_grad_norm must reach the engine's config (the old
    # check sent users to gradient_clip_val, which Lightning then refused).
    from types import SimpleNamespace

    from lightning_vlm.methods.online import OnlineRL

    cfg = compose_train([f"trainer={trainer}", "method=grpo"], tmp_path)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert "gradient_clipping" not in strategy.config and cfg.trainer.gradient_clip_val is None
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy), hparams=cfg.method)
    OnlineRL.setup(module, "fit")  # the hook runs before the strategy builds its engine
    assert strategy.config["gradient_clipping"] == cfg.method.max_grad_norm == 1.0
    # A config's own clip ("auto" is filled): one that differs was replaced without a word.
    strategy.config["gradient_clipping"] = "auto"
    OnlineRL.setup(module, "fit")
    assert strategy.config["gradient_clipping"] == 1.0
    strategy.config["gradient_clipping"] = 0.5
    with pytest.raises(ValueError, match=r"gradient_clipping=0.5 differs from method.max_grad_norm=1.0"):
        OnlineRL.setup(module, "fit")


@pytest.mark.parametrize("trainer", ["deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_the_export_refuses_zero3_s_partitioned_weights_before_training(trainer, tmp_path):
    from types import SimpleNamespace

    from lightning_vlm.callbacks.export import ExportHFModel

    cfg = compose_train([f"trainer={trainer}", "callbacks=[none,export]"], tmp_path)
    export = hydra.utils.instantiate(cfg.callbacks.export)
    fake = SimpleNamespace(strategy=hydra.utils.instantiate(cfg.trainer.strategy))
    if trainer == "deepspeed_zero3":
        with pytest.raises(ValueError, match="ZeRO-3 would save partitioned"):
            export.setup(fake, None, "fit")
    else:  # ZeRO-2 keeps whole weights on every rank; FSDP's export gathers them
        export.setup(fake, None, "fit")
    assert isinstance(export, ExportHFModel)


@pytest.mark.parametrize("trainer", ["deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_vllm_generation_refuses_zero3_s_partitioned_weights_before_training(trainer, tmp_path):
    # Only FSDP's units were gathered for the sync: under ZeRO-3 state_dict() gives empty partitions,
    # which vLLM's weight loader would have met without a word about the strategy.
    from types import SimpleNamespace

    cfg = compose_train([f"trainer={trainer}", "method=grpo", "generation=vllm_colocate"], tmp_path)
    callback = hydra.utils.instantiate(cfg.callbacks.vllm_generation)
    fake = SimpleNamespace(strategy=hydra.utils.instantiate(cfg.trainer.strategy))
    if trainer == "deepspeed_zero3":
        with pytest.raises(ValueError, match="ZeRO-3 would push partitioned"):
            callback.setup(fake, None, "fit")
    else:  # reaches the next check (a module that is no online method), past the strategy's
        with pytest.raises(TypeError, match="VLLMGeneration needs a module"):
            callback.setup(fake, None, "fit")


# One gloo process in its own interpreter (a process group is global state): FSDP wraps a bf16 model whose
# LoRA adapters PEFT keeps in fp32, as model=qwen2_5_vl_7b and llava_next (conf/model/_real_lora.yaml) are.
_BF16_LORA_UNDER_FSDP = """
import socket, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.fsdp import layer_classes, wrap_policy
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
vlm = VLM(sys.argv[1], dtype="bfloat16", lora={"r": 4, "lora_alpha": 8})
assert {p.dtype for n, p in vlm.named_parameters() if ".lora_" in n} == {torch.float32}
inputs = vlm.encode_sft(synthetic_rows("sft", 2, seed=0))
mask = inputs.pop("labels") != -100
FSDP(vlm, auto_wrap_policy=wrap_policy(vlm, layer_classes(vlm)), device_id=torch.device("cpu"),
     use_orig_params=True)
logps, _ = vlm.token_logps(inputs, mask)
(-logps[mask].mean()).backward()
print("trained", sum(p.grad is not None for n, p in vlm.named_parameters() if ".lora_" in n))
# An fp32 model keeps its adapters in their layer's unit: PEFT reads an embedding LoRA's factors (and
# DoRA's) outside their own forward, which a unit of their own would leave sharded.
vlm = VLM(sys.argv[1], lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "embed_tokens"]})
root = torch.nn.Module()
root.vlm = vlm
FSDP(root, auto_wrap_policy=wrap_policy(vlm, layer_classes(vlm)), device_id=torch.device("cpu"),
     use_orig_params=True)
logps, _ = vlm.token_logps(inputs, mask)
(-logps[mask].mean()).backward()
dist.destroy_process_group()
"""


def test_fsdp_wraps_a_bf16_model_with_fp32_lora_adapters(tiny_path):
    # Each decoder layer was one unit of bf16 base and fp32 adapter weights: "Must flatten tensors with
    # uniform dtype", for `trainer=fsdp model=qwen2_5_vl_7b` as README gives it. Adapters are units of their own.
    import os
    import subprocess
    import sys

    from helpers import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", _BF16_LORA_UNDER_FSDP, tiny_path()], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("trained")[-1]) > 0  # the adapters got gradients


def test_fsdp_without_orig_params_is_refused_by_what_reads_weights_by_name(tmp_path):
    # FSDP's units then hold flat parameters (_flat_param): the export wrote a folder with none of the
    # model's weights (transformers loads it as random ones), the vLLM sync pushed names vLLM lacks.
    overrides = [
        "method=grpo",
        "generation=vllm_colocate",
        "trainer=fsdp",
        "callbacks=[default,export,sync_ref]",
    ]
    cfg = compose_train([*overrides, "trainer.strategy.use_orig_params=false"], tmp_path)
    trainer = SimpleNamespace(strategy=hydra.utils.instantiate(cfg.trainer.strategy))
    for name in ("export", "vllm_generation"):
        with pytest.raises(ValueError, match=r"use_orig_params=true"):
            hydra.utils.instantiate(cfg.callbacks[name]).setup(trainer, None, "fit")
    with pytest.raises(ValueError, match=r"callbacks.sync_ref .*use_orig_params=true"):
        hydra.utils.instantiate(cfg.callbacks.sync_ref).check(trainer.strategy, None)
    check_orig_params(hydra.utils.instantiate(compose_train(overrides, tmp_path).trainer.strategy), "x")
