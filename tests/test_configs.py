"""Every config composes, and every node it holds instantiates (or, for hub models, binds)."""

from __future__ import annotations

import inspect

import hydra
import pytest
from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf

from helpers import compose_train, group_options
from lightning_vlm.training import instantiate_group

REAL_MODELS = ["qwen2_5_vl", "qwen2_5_vl_7b", "qwen2_vl", "gemma3", "llava_next", "smolvlm"]


def _bind(node: DictConfig) -> None:
    """Checks a node's keys against its target's signature without running it (no download)."""
    target = node["_target_"]
    try:
        fn = get_class(target)
    except Exception:
        fn = get_method(target)
    kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
    inspect.signature(fn).bind_partial(**kwargs)


@pytest.mark.parametrize(
    "group", ["method", "model", "data", "trainer", "callbacks", "logger", "experiment", "debug", "lora"]
)
def test_every_option_composes(group, tmp_path):
    for option in group_options(group):
        cfg = compose_train([f"{group}={option}"], tmp_path)
        assert cfg.method._target_ and cfg.model._target_ and cfg.data._target_
        OmegaConf.to_container(cfg.data, resolve=True)


def test_hparams_search_composes(tmp_path):
    for option in group_options("hparams_search"):
        cfg = compose_train([f"hparams_search={option}"], tmp_path)
        assert cfg.hydra.sweeper.params


@pytest.mark.parametrize("model", REAL_MODELS)
def test_real_model_configs_bind(model, tmp_path):
    cfg = compose_train([f"model={model}"], tmp_path)
    assert "/" in cfg.model.model_name_or_path and cfg.trainer.precision == "bf16-mixed"
    # fp32 master weights for full fine-tuning; bf16 weights only under LoRA (the 7B)
    assert cfg.model.dtype == ("bfloat16" if cfg.model.lora else "float32")
    _bind(cfg.model)


@pytest.mark.parametrize("method", group_options("method"))
def test_method_nodes_instantiate(method, tmp_path):
    cfg = compose_train([f"method={method}"], tmp_path)
    datamodule = hydra.utils.instantiate(cfg.data)
    vlm = hydra.utils.instantiate(cfg.model)
    module = hydra.utils.instantiate(cfg.method, vlm=vlm)
    assert module.vlm is vlm and datamodule is not None
    trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=instantiate_group(cfg.callbacks),
        logger=instantiate_group(OmegaConf.merge(cfg.logger, {"wandb": {"offline": True}})),
    )
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("group", ["callbacks", "logger"])
def test_callback_and_logger_options_instantiate(group, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for option in group_options(group):
        cfg = compose_train([f"{group}={option}"], tmp_path)
        nodes = cfg[group] or {}
        built = instantiate_group(nodes)
        assert len(built) == sum(1 for node in nodes.values() if "_target_" in node)
