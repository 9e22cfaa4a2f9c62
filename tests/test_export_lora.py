"""ExportHFModel after a LoRA run: the folder is a plain merged HF model (no adapters) that transformers
loads with the logits of the trained PEFT model, images included, and the trained model keeps its adapters."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from helpers import compose_train
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.models.vlm import PRIVATE_KEYS
from lightning_vlm.training import train


@pytest.mark.parametrize("model", ["tiny_qwen2_5_vl", "tiny_gemma3"])
def test_lora_run_exports_a_merged_model_with_the_trained_logits(model, tmp_path):
    folder = tmp_path / "hf"
    cfg = compose_train(
        [f"model={model}", "lora=default", "callbacks=[none,export]", f"callbacks.export.dirpath={folder}",
         "logger=none", "trainer.max_steps=2", "trainer.limit_val_batches=0", "data.batch_size=4",
         "trainer.enable_progress_bar=false"],
        tmp_path,
    )  # fmt: skip
    _, out = train(cfg)
    vlm = out["module"].vlm
    assert vlm.is_lora, "the export merges into a copy: the trained model keeps its adapters"

    # A plain transformers folder: full weights under HF names, no adapter files or LoRA factors.
    assert not (folder / "adapter_config.json").exists()
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert names and not any("lora_" in n or "base_layer" in n or "modules_to_save" in n for n in names)
    exported = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()

    inputs = vlm.encode_sft(synthetic_rows("sft", 3, seed=11))
    args = {k: v for k, v in vlm.model_inputs(inputs).items() if k not in (*PRIVATE_KEYS, "labels")}
    assert "pixel_values" in args
    vlm.model.eval()
    with torch.no_grad():
        trained = vlm.model(**args).logits
        with vlm.model.disable_adapter():
            base = vlm.model(**args).logits
        merged = exported(**args).logits
    # the adapters (and lm_head, trained beside them) changed the model, and the export has that change
    assert (trained - base).abs().max() > 1e-3
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-5)
