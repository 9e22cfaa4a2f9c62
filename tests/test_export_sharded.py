"""The export written from a model's state in parts (what every rank gathers under FSDP, one unit at a
time, rank 0 writing) is the folder ``VLM.save_pretrained`` writes: same files, names and tensors, for
every tiny family (Gemma 4's tied LM head saved once), LoRA merged or as an adapter. Under FSDP itself:
tests/test_ddp_equivalence.py (``fsdp_export``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.export import write_folder

CASES = [(family, None) for family in TINY_FAMILIES] + [("qwen2_5_vl", True), ("qwen2_5_vl", False)]


def _weights(folder) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(files[0])


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
