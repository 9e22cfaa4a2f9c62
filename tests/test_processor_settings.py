"""``model.processor_kwargs`` are checked against what the processor reads (models/processor_settings.py):
a name no part of it reads is refused, as transformers drops it silently (Qwen's ``max_pixels`` on
another family left images at full size); every hub config's own settings pass on its family's processor."""

from __future__ import annotations

import re
from typing import TypedDict

import pytest
from omegaconf import OmegaConf
from transformers import AutoProcessor

from helpers import compose_train, group_options
from lightning_vlm.models.families import FAMILIES
from lightning_vlm.models.processor_settings import check_loading_options, check_processor_settings
from lightning_vlm.models.tiny import TINY_FAMILIES

# hub model config -> the tiny family with its processor classes, from the registry's hub_config (SmolVLM's
# is Idefics3's tiny model); the 7B Qwen2.5-VL config is the only hub config no record names
HUB_FAMILY = {
    f.hub_config: name for name, f in FAMILIES.items() if f.hub_config and name in TINY_FAMILIES
} | {"qwen2_5_vl_7b": "qwen2_5_vl"}


def _settings(config: str) -> dict:
    # composed, as a run gets them (qwen2_5_vl_7b's come from its defaults)
    settings = compose_train([f"model={config}"]).model.processor_kwargs
    return OmegaConf.to_container(settings) if settings is not None else {}


def test_every_hub_config_is_mapped():
    assert set(HUB_FAMILY) == {o for o in group_options("model") if not o.startswith("tiny_")}


@pytest.mark.parametrize("config", sorted(HUB_FAMILY))
def test_the_hub_configs_settings_are_read_by_their_processor(config, tiny_path):
    settings = _settings(config)
    if config == "llava_next":
        assert settings == {}  # its images are limited by the checkpoint's grid pinpoints
        return
    assert settings, config  # a hub config without settings would check nothing here
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
        {"image_seq_length": 64},  # a per-call setting of the processor
    ],
)
def test_settings_some_part_reads_pass(settings, tiny_path):
    processor = AutoProcessor.from_pretrained(tiny_path("qwen2_5_vl"), **settings)
    check_processor_settings(processor, settings)


def test_settings_of_an_audio_part_pass(tiny_path):
    # Gemma 4's processor has a feature extractor too; from_pretrained applies its settings
    processor = AutoProcessor.from_pretrained(tiny_path("gemma4"), max_frequency=5000.0)
    check_processor_settings(processor, {"max_frequency": 5000.0})


def test_loading_options_the_model_sets_are_refused_naming_where_they_go():
    # given twice to from_pretrained (TypeError), or a processor from another revision than the weights
    with pytest.raises(ValueError, match=r"\['trust_remote_code', 'revision'\]: set model\.trust_remote_code, "
                                         r"model\.model_kwargs\.revision instead"):  # fmt: skip
        check_loading_options({"trust_remote_code": True, "revision": "main", "size": {}})
    check_loading_options({"size": {}, "use_fast": True})


class _Settings(TypedDict, total=False):
    size: dict
    shape_of_things: NotImportedHere  # noqa: F821  (remote code may name types that do not import here)


class _ImageProcessor:
    valid_kwargs = _Settings
    legacy_knob = 1  # a class attribute: transformers applies a keyword wherever hasattr finds it


class _Processor:
    """Remote code of the usual shape: an image processor with declared settings."""

    valid_processor_kwargs = None

    def __init__(self) -> None:
        self.image_processor, self.tokenizer = _ImageProcessor(), None

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def test_remote_code_with_unresolvable_annotations_and_class_attributes():
    processor = _Processor()
    check_processor_settings(processor, {"size": {}, "shape_of_things": 1, "legacy_knob": 2})
    with pytest.raises(ValueError, match=r"\['max_pixels'\].*_ImageProcessor, takes: shape_of_things, size"):
        check_processor_settings(processor, {"max_pixels": 1})


@pytest.mark.parametrize(
    ("key", "setting"),
    [("torch_dtype", "model.dtype"), ("dtype", "model.dtype"), ("attn_implementation", "model.attn_implementation"),
     ("trust_remote_code", "model.trust_remote_code")],
)  # fmt: skip
def test_model_kwargs_that_the_models_own_settings_give_are_refused_naming_them(tiny_path, key, setting):
    # TRL's torch_dtype in model.model_kwargs was dropped (the model loaded in float32, a deprecation warning
    # aside); dtype or attn_implementation there was a TypeError ("got multiple values") naming no setting.
    from lightning_vlm.models.vlm import VLM

    value = {"torch_dtype": "bfloat16", "dtype": "bfloat16", "attn_implementation": "sdpa"}.get(key, True)
    with pytest.raises(ValueError, match=re.escape(f"model.model_kwargs ['{key}']: set {setting}={value!r}")):
        VLM(tiny_path(), model_kwargs={key: value})
