"""The export written from a model's state in parts (what every rank gathers under FSDP, one unit at a
time, rank 0 writing) is the folder ``VLM.save_pretrained`` writes: same files, names and tensors, for
every tiny family (Gemma 4's tied LM head saved once), LoRA merged or as an adapter. Under FSDP itself:
tests/test_ddp_equivalence.py (``fsdp_export``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lightning_vlm.models.families import family_of
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.export import write_folder

CASES = [(family, None) for family in TINY_FAMILIES] + [("qwen2_5_vl", True), ("qwen2_5_vl", False)]


def _weights(folder) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(files[0])


def _readable_as_the_umask_allows(folder) -> None:
    # safetensors 0.8 writes owner-only files (0600): a teammate, or a vLLM server run as another user,
    # could read the exported folder's config but not its weights.
    from lightning_vlm.models.weight_names import _umask

    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.glob("*.safetensors")}
    assert modes and set(modes.values()) == {oct(0o666 & ~_umask())}, modes


# Families whose tower names are rewritten for vLLM after saving (weight_names.save_for_hf_and_vllm).
RENAMED = [f for f in TINY_FAMILIES if family_of(f).vllm_vision_model_prefix]


@pytest.mark.parametrize("family", [*RENAMED, "qwen2_5_vl"])
def test_a_model_over_max_shard_size_is_written_in_the_same_shards_both_ways(family, tiny_path, tmp_path):
    # The vLLM renaming read model.safetensors alone: a model sharded by save_pretrained (transformers'
    # default is 50GB: Gemma 3 27B in bf16) failed at the end of training with FileNotFoundError, and the
    # FSDP export wrote one file whatever the size.
    from transformers import AutoModelForImageTextToText

    vlm = VLM(tiny_path(family))
    vlm.save_pretrained(tmp_path / "whole", max_shard_size="300KB")
    write_folder(vlm, tmp_path / "parts", [vlm.model.state_dict()], merge_lora=True, max_shard_size="300KB")
    index = "model.safetensors.index.json"
    whole, parts = (json.loads((tmp_path / f / index).read_text()) for f in ("whole", "parts"))
    assert whole == parts and len(set(whole["weight_map"].values())) > 1
    _readable_as_the_umask_allows(tmp_path / "whole")
    _readable_as_the_umask_allows(tmp_path / "parts")
    for shard in sorted(set(whole["weight_map"].values())):
        a, b = load_file(tmp_path / "whole" / shard), load_file(tmp_path / "parts" / shard)
        assert a.keys() == b.keys() == {k for k, v in whole["weight_map"].items() if v == shard}
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    unsharded = VLM(tiny_path(family)).hf_model.state_dict()
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "parts").state_dict()
    assert reloaded.keys() == unsharded.keys()
    for name, tensor in unsharded.items():
        torch.testing.assert_close(reloaded[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", RENAMED)
def test_a_lora_adapter_of_a_renamed_family_saves(family, tiny_path, tmp_path):
    # save_for_hf_and_vllm renamed model.safetensors after PEFT had written adapter_model.safetensors:
    # ExportHFModel(merge_lora=false) failed at the end of fit for LLaVA, LLaVA-Next and Gemma 3.
    vlm = VLM(tiny_path(family), lora={"r": 4, "lora_alpha": 8})
    vlm.save_pretrained(tmp_path / "whole", merge_lora=False)
    write_folder(vlm, tmp_path / "parts", [vlm.model.state_dict()], merge_lora=False)
    whole, parts = load_file(tmp_path / "whole" / "adapter_model.safetensors"), _weights(tmp_path / "parts")
    assert whole.keys() == parts.keys() and whole
    _readable_as_the_umask_allows(tmp_path / "whole")


@pytest.mark.parametrize(("family", "merge"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_the_folder_from_parts_is_save_pretrained_s(family, merge, tiny_path, tmp_path):
    torch.manual_seed(0)
    lora = {"r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]} if merge is not None else None
    vlm = VLM(tiny_path(family), lora=lora)
    if lora:  # adapters away from their zero init, so a merge that dropped them would show
        with torch.no_grad():
            for name, p in vlm.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    merge = bool(merge) if merge is not None else True
    vlm.save_pretrained(tmp_path / "whole", merge_lora=merge)
    write_folder(vlm, tmp_path / "parts", [vlm.model.state_dict()], merge_lora=merge)
    whole, parts = _weights(tmp_path / "whole"), _weights(tmp_path / "parts")
    assert whole.keys() == parts.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(parts[name], tensor, rtol=0, atol=0, msg=name)
    # (PEFT adds a README.md stub to an adapter folder; ExportHFModel writes its own card when it pushes.)
    besides = {p.name for p in (tmp_path / "whole").iterdir() if p.suffix not in (".safetensors", ".md")}
    assert besides == {p.name for p in (tmp_path / "parts").iterdir() if p.suffix != ".safetensors"}


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_second_export_into_a_sharded_folder_leaves_no_stale_index(family, tiny_path, tmp_path):
    # transformers removed the shards but kept the index: the renaming opened shards that were gone
    # (LLaVA, Gemma 3), and other families left an index beside the single model.safetensors.
    from lightning_vlm.models.weight_names import save_for_hf_and_vllm

    model = VLM(tiny_path(family)).model
    save_for_hf_and_vllm(model, tmp_path, "200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_for_hf_and_vllm(model, tmp_path, None)
    assert sorted(p.name for p in tmp_path.glob("model*.safetensors*")) == ["model.safetensors"]
    assert load_file(tmp_path / "model.safetensors")


EXPORTS = {
    "full": ({"model.safetensors", "config.json"}, {"adapter_config.json", "adapter_model.safetensors"}),
    "sharded": (
        {"model.safetensors.index.json", "config.json"},
        {"model.safetensors", "adapter_config.json"},
    ),
    "adapter": ({"adapter_config.json", "adapter_model.safetensors"}, {"model.safetensors", "config.json"}),
}


@pytest.mark.parametrize("writer", ["save_pretrained", "parts"])
@pytest.mark.parametrize(("first", "second"), [("adapter", "full"), ("full", "adapter"), ("full", "sharded")])
def test_a_second_export_into_a_folder_leaves_none_of_the_first_ones_model_files(
    first, second, writer, tiny_path, tmp_path
):
    # Left beside the new files, transformers loaded the wrong weights without a word: the old adapter
    # on the new full model, the new adapter on the old full model, the old single file before new shards.
    lora = VLM(tiny_path(), lora={"r": 4, "lora_alpha": 8})

    def export(kind: str) -> None:
        shard = "200KB" if kind == "sharded" else None
        if writer == "save_pretrained":
            lora.save_pretrained(tmp_path, merge_lora=kind != "adapter", max_shard_size=shard)
        else:
            write_folder(lora, tmp_path, [lora.model.state_dict()], kind != "adapter", shard)

    export(first)
    export(second)
    names = {p.name for p in tmp_path.iterdir()}
    present, absent = EXPORTS[second]
    assert present <= names and not absent & names, sorted(names)
