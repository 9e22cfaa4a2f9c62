"""``model.processor_kwargs`` are checked against what the processor reads (models/processor_settings.py):
a name no part of it reads is refused, as transformers drops it silently (Qwen's ``max_pixels`` on
another family left images at full size); every hub config's own settings pass on its family's processor."""

from __future__ import annotations

import re

import pytest
import yaml
from transformers import AutoProcessor

from helpers import CONF, group_options
from lightning_vlm.models.processor_settings import check_processor_settings

# hub model config -> the tiny family with its processor classes (SmolVLM is Idefics3's)
HUB_FAMILY = {
    "gemma3": "gemma3", "gemma4": "gemma4", "internvl": "internvl", "llava_next": "llava_next",
    "qwen2_5_vl": "qwen2_5_vl", "qwen2_5_vl_7b": "qwen2_5_vl", "qwen2_vl": "qwen2_vl", "qwen3_5": "qwen3_5",
    "qwen3_vl": "qwen3_vl", "smolvlm": "idefics3",
}  # fmt: skip


def _settings(config: str) -> dict:
    return yaml.safe_load((CONF / "model" / f"{config}.yaml").read_text()).get("processor_kwargs") or {}


def test_every_hub_config_is_mapped():
    assert set(HUB_FAMILY) == {o for o in group_options("model") if not o.startswith("tiny_")}


@pytest.mark.parametrize("config", sorted(HUB_FAMILY))
def test_the_hub_configs_settings_are_read_by_their_processor(config, tiny_path):
    settings = _settings(config)
    processor = AutoProcessor.from_pretrained(tiny_path(HUB_FAMILY[config]), **settings)
    check_processor_settings(processor, settings)


@pytest.mark.parametrize(
    ("family", "settings", "unread"),
    [
        ("gemma3", {"max_pixels": 12544}, ["max_pixels"]),
        ("internvl", {"min_pixels": 3136, "max_patches": 4}, ["min_pixels"]),
        ("llava_next", {"max_pixels": 12544}, ["max_pixels"]),
        ("qwen2_5_vl", {"max_pixel": 12544}, ["max_pixel"]),  # a typo
    ],
)
def test_a_setting_nothing_reads_is_refused_naming_it_and_what_is_read(family, settings, unread, tiny_path):
    processor = AutoProcessor.from_pretrained(tiny_path(family), **settings)
    with pytest.raises(ValueError, match=re.escape(f"model.processor_kwargs {unread}: ")) as err:
        check_processor_settings(processor, settings)
    assert "reads no such setting" in str(err.value)
    assert "size" in str(err.value).split("takes:")[1].split(", ")  # the image settings it does read


@pytest.mark.parametrize(
    "settings",
    [
        {"max_pixels": 12544, "min_pixels": 3136},  # Qwen's own, read though never set as attributes
        {"size": {"longest_edge": 448}},
        {"padding_side": "left"},  # the tokenizer's
        {"use_fast": True},  # from_pretrained's
    ],
)
def test_settings_some_part_reads_pass(settings, tiny_path):
    processor = AutoProcessor.from_pretrained(tiny_path("qwen2_5_vl"), **settings)
    check_processor_settings(processor, settings)
