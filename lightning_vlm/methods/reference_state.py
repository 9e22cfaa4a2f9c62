"""The reference model in checkpoints, once TR-DPO's syncs have moved it (``callbacks/reference_sync.py``).

A checkpoint holds the policy, not the frozen reference copy: a resume or an evaluation rebuilds the copy
from ``model.model_name_or_path`` (and ``callbacks/run_identity.py`` checks it is the same). A synced copy
can no longer be rebuilt, so from the first sync on every checkpoint also holds its weights (one more copy
of the model), and loading one puts them back: a resumed run scores against the reference the
uninterrupted run would, and eval.py against the one training ended with, with or without the callback.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_vlm.models.reference import ReferenceModel

KEY = "lightning_vlm/reference_weights"


class KeepsReference(L.LightningModule):
    """The checkpoint hooks of the methods with a reference model (DPO, KTO, the online methods); first in
    their bases, so that the other hooks run too."""

    ref: ReferenceModel | None

    def training_reference(self) -> ReferenceModel | None:
        """The reference model training scores against (None: the method has none in this run)."""
        return self.ref

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        weights = self.ref.moved_weights() if self.ref is not None else None
        if weights is not None:
            checkpoint[KEY] = weights

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        weights = checkpoint.get(KEY)
        if weights is None:
            return
        reference = self.training_reference()
        if reference is None or reference.shares_weights:
            raise ValueError(
                "this checkpoint's reference model was synced with the policy during training "
                "(callbacks=[...,sync_ref], TR-DPO), and this run has no frozen reference copy to take it: "
                "load it with the settings it trained with (no LoRA, no method.precompute_ref_logps, "
                "method.beta > 0 for GRPO and RLOO)"
            )
        reference.load_moved_weights(weights)
