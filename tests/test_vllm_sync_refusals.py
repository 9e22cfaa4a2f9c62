"""LoRA settings the vLLM weight sync cannot carry are refused when the generator is built, naming the
setting: each would leave vLLM sampling from other weights than those trained, silently, or fail at the
first sync. And the engine options a Hydra node passes reach vLLM as plain values."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lightning_vlm.generation.engine_options import EngineOptions
from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator, adapter_engine_options
from lightning_vlm.generation.weight_sync import check_syncable
from lightning_vlm.models.vlm import VLM

LORA = {"r": 4, "lora_alpha": 8}


@pytest.mark.parametrize(
    ("lora", "refused"),
    [
        # o_proj has no bias in Qwen2: the trained bias had nowhere to go and was dropped from the sync.
        ({"target_modules": ["o_proj"], "lora_bias": True}, r"lora_bias trains a bias for .*o_proj"),
        ({"trainable_token_indices": [1, 2]}, r"trainable_token_indices trains rows of .*embed_tokens"),
        ({"use_dora": True}, r"DoRA layer \(model.lora.use_dora\)"),
    ],
    ids=["lora-bias-without-base-bias", "trainable-tokens", "dora"],
)
def test_lora_parts_the_merged_sync_cannot_carry_are_refused(tiny_path, lora, refused):
    vlm = VLM(tiny_path(), lora={**LORA, **lora})
    with pytest.raises(ValueError, match=refused):
        VLLMColocateGenerator(vlm)  # raises before the engine is built
    # q_proj and v_proj have a bias in Qwen2: there lora_bias merges into it (test_vllm_units).
    check_syncable(VLM(tiny_path(), lora={**LORA, "target_modules": ["q_proj", "v_proj"], "lora_bias": True}))


def test_adapter_sync_refuses_inits_that_rewrite_the_base_and_sizes_for_the_largest_rank(tiny_path):
    # PiSSA leaves W - BA in the model: vLLM adds BA to the W on disk, counting it twice.
    pissa = VLM(tiny_path(), lora={**LORA, "init_lora_weights": "pissa"})
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' rewrites the base weights"):
        VLLMColocateGenerator(pissa, weight_sync="adapter")
    check_syncable(pissa)  # the merged sync pushes the rewritten base with the adapter merged: exact
    # A rank_pattern rank above r: vLLM refused the adapter at the first generation ("LoRA rank 32 is
    # greater than max_lora_rank 8").
    patterned = VLM(tiny_path(), lora={**LORA, "rank_pattern": {"q_proj": 32}})
    assert adapter_engine_options(patterned)["max_lora_rank"] == 32


def test_nested_engine_extras_reach_vllm_as_plain_dicts():
    node = OmegaConf.create({"extra": {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}})
    extra = EngineOptions.build(node).extra
    assert extra == {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    assert type(extra["compilation_config"]) is dict  # vLLM's pydantic config refused a DictConfig


def test_a_row_with_more_images_than_the_engine_takes_names_the_setting():
    from PIL import Image

    from lightning_vlm.generation.vllm_engine import check_image_counts

    rows = [{"images": []}, {"images": [Image.new("RGB", (8, 8))] * 5}]
    with pytest.raises(
        ValueError, match=r"row 1 .* 5 images.*at most 4.*engine.limit_mm_per_prompt=\{image:5"
    ):
        check_image_counts(rows, EngineOptions())
    check_image_counts(rows, EngineOptions.build(OmegaConf.create({"limit_mm_per_prompt": {"image": 5}})))
    # vLLM's dict form counts too; a limit that lists no image is vLLM's own to enforce (999 in 0.32).
    counted = EngineOptions.build(
        {"limit_mm_per_prompt": {"image": {"count": 4, "width": 224, "height": 224}}}
    )
    with pytest.raises(ValueError, match=r"at most 4"):
        check_image_counts(rows, counted)
    check_image_counts(rows, EngineOptions.build({"limit_mm_per_prompt": {"video": 0}}))
