"""A pretrained model under the tiny models' settings is refused with the model=<family> to use."""

from __future__ import annotations

import shutil

import pytest
from transformers import Qwen2_5_VLConfig

from helpers import compose_train
from lightning_vlm.models.scale_guard import check_model_scale
from lightning_vlm.training import train


@pytest.fixture(scope="module")
def qwen_3b_config_dir(tmp_path_factory):
    """A folder with only Qwen2.5-VL-3B's config.json (its sizes; no weights, as a hub snapshot would
    be before the weights download)."""
    out = tmp_path_factory.mktemp("qwen3b")
    Qwen2_5_VLConfig(
        text_config={"hidden_size": 2048, "num_hidden_layers": 36, "intermediate_size": 11008,
                     "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936},
        vision_config={"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048, "intermediate_size": 3420},
    ).save_pretrained(out)  # fmt: skip
    return out


def test_a_3b_model_under_the_default_tiny_settings_is_refused_naming_its_family(
    qwen_3b_config_dir, tmp_path
):
    cfg = compose_train([f"model.model_name_or_path={qwen_3b_config_dir}"], tmp_path)
    with pytest.raises(
        ValueError, match=r"[34]\.\d\d B parameters.*`model=qwen2_5_vl model.model_name_or_path="
    ):
        train(cfg)


def test_the_same_model_with_its_family_config_passes_the_check(qwen_3b_config_dir, tmp_path):
    cfg = compose_train(["model=qwen2_5_vl", f"model.model_name_or_path={qwen_3b_config_dir}"], tmp_path)
    assert cfg.scale.name == "real"
    check_model_scale(cfg.scale.name, cfg.model.model_name_or_path)


def test_a_hub_id_that_cannot_be_read_offline_is_refused_with_the_family_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_train(["method=grpo", "model.model_name_or_path=Qwen/Qwen2.5-VL-3B-Instruct"], tmp_path)
    with pytest.raises(ValueError, match=r"tiny models' settings.*model=qwen2_5_vl.*model=smolvlm"):
        train(cfg)


def test_tiny_models_and_their_exports_pass(tiny_path, tmp_path):
    check_model_scale("tiny", tiny_path("qwen2_5_vl"))  # in the tiny cache: not even read
    for family in ("qwen2_5_vl", "idefics3"):  # an export elsewhere: its parameters are counted
        shutil.copy(f"{tiny_path(family)}/config.json", tmp_path / "config.json")
        check_model_scale("tiny", str(tmp_path))


def test_a_3b_model_in_the_runs_own_hub_cache_is_refused_too(qwen_3b_config_dir, tmp_path, monkeypatch):
    # model.model_kwargs.cache_dir: the model loads from there, but the guard read the default cache,
    # found nothing, and refused with "its config cannot be read" instead of naming the family.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--someone--big-vlm"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(qwen_3b_config_dir / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    overrides = [
        "model.model_name_or_path=someone/big-vlm",
        f"model.model_kwargs={{cache_dir:{tmp_path / 'hub'}}}",
    ]
    with pytest.raises(ValueError, match=r"[34]\.\d\d B parameters.*`model=qwen2_5_vl"):
        train(compose_train(overrides, tmp_path))
