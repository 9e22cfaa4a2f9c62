"""Export the trained policy as a Hugging Face folder, so the next method can start from it."""

from __future__ import annotations

from pathlib import Path

import lightning as L


class ExportHFModel(L.Callback):
    """At the end of fit, saves the policy (LoRA merged) and processor with ``save_pretrained``.

    The folder loads with ``model.model_name_or_path=<dir>`` — e.g. an SFT warm start for GRPO.
    """

    def __init__(self, dirpath: str, merge_lora: bool = True) -> None:
        self.dirpath = Path(dirpath)
        self.merge_lora = merge_lora

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            pl_module.vlm.save_pretrained(self.dirpath, merge_lora=self.merge_lora)
