"""TR-DPO's reference syncs (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"),
TRL's ``sync_ref_model``: every ``sync_steps`` optimizer steps the frozen reference copy becomes
``mixup_alpha`` x the policy + (1 - ``mixup_alpha``) x itself (TRL's ``ref_model_sync_steps`` and
``ref_model_mixup_alpha``; its defaults, 512 and 0.6). For every method with a frozen reference: DPO and
MPO, KTO, and GRPO, RLOO and Online DPO with a KL term (``method.beta`` > 0).

    python train.py method=dpo callbacks=[default,sync_ref] callbacks.sync_ref.sync_steps=64

The mix runs right after the optimizer step it follows (a hook on the optimizer), so the online methods,
which take several steps per generation, sync at the step TRL's ``on_step_end`` would, and a checkpoint
written at that step already holds the mixed copy (``methods/reference_state.py`` saves it). As TRL, it
refuses LoRA (the reference is the policy with its adapters off, no weights of its own) and precomputed
reference log-probs. It runs on one process, under DDP, where every rank mixes the same weights, and
under FSDP, which gathers the sharded policy one unit at a time for the mix (the reference copy is whole on
every rank there, as without syncs). DeepSpeed steps its optimizer inside its engine: refused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch.utils.hooks import RemovableHandle

from lightning_vlm.methods.reference_state import KeepsReference
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.parallel.fsdp import check_orig_params, clean_name, sharded_root, unit_state_chunks

log = logging.getLogger(__name__)


class ReferenceSync(L.Callback):
    """Mixes the policy into the frozen reference every ``sync_steps`` optimizer steps (TR-DPO)."""

    def __init__(self, mixup_alpha: float = 0.6, sync_steps: int = 512) -> None:
        if not 0 < mixup_alpha <= 1:
            raise ValueError(
                f"callbacks.sync_ref.mixup_alpha must be in (0, 1] (1: a copy), got {mixup_alpha!r}"
            )
        if not isinstance(sync_steps, int) or isinstance(sync_steps, bool) or sync_steps <= 0:
            raise ValueError(f"callbacks.sync_ref.sync_steps must be a whole number > 0, got {sync_steps!r}")
        self.mixup_alpha, self.sync_steps = mixup_alpha, sync_steps
        self._hooks: list[RemovableHandle] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before any step (and before DPO's precompute or a checkpoint's restore)
            self.check(trainer.strategy, pl_module)

    def check(self, strategy: Strategy, pl_module: L.LightningModule) -> ReferenceModel:
        """The reference model to sync; refuses a strategy or a method it cannot sync, naming the setting."""
        name = type(pl_module).__name__
        if isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(
                "callbacks.sync_ref (TR-DPO) runs on one process, trainer=ddp or trainer=fsdp, not DeepSpeed, "
                "whose optimizer steps inside its engine"
            )
        check_orig_params(strategy, "callbacks.sync_ref (TR-DPO)")
        reference = pl_module.training_reference() if isinstance(pl_module, KeepsReference) else None
        if reference is None:
            raise ValueError(
                f"callbacks.sync_ref (TR-DPO) moves the reference model, and {name} trains without one here: "
                "SFT has none, GRPO and RLOO only with method.beta > 0, and DPO's method.precompute_ref_logps=true "
                "replaces it with stored log-probs (TRL refuses that too)"
            )
        if reference.shares_weights:
            raise ValueError(
                "callbacks.sync_ref (TR-DPO) moves the reference model's weights, and with LoRA the reference is "
                "the policy with its adapters off, with no weights of its own (TRL refuses this too): train "
                "without lora, or drop sync_ref"
            )
        return reference

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Optimizers exist (and are restored) by now. The hook runs inside every real step, automatic or
        # manual, and only then: accumulated micro-batches add no sync, and neither does a step the fp16
        # loss scaler skips (Lightning counts it; TRL's on_step_end would sync there).
        reference = self.check(trainer.strategy, pl_module)
        root = sharded_root(trainer.strategy.model)
        trainable = {clean_name(n) for n, p in pl_module.vlm.hf_model.named_parameters() if p.requires_grad}
        if not trainable & dict(reference.copy.named_parameters()).keys():
            # Names that do not match (FSDP's flat parameters are refused by check above): nothing would be mixed.
            raise ValueError(
                "callbacks.sync_ref finds none of the policy's trainable weights in the reference copy by "
                "name, so it would mix nothing"
            )

        def parts() -> Iterator[dict[str, torch.Tensor]] | None:
            if root is None:
                return None  # the policy's own parameters, whole on every process
            # FSDP: one unit gathered at a time (a collective: every rank syncs at the same step)
            chunks = unit_state_chunks(root, pl_module.vlm.hf_model)
            return ({n: t for n, t in chunk.items() if n in trainable} for chunk in chunks)

        def after_step(*_: Any) -> None:
            # Lightning counts the step once the optimizer returns: this is step global_step + 1.
            if (trainer.global_step + 1) % self.sync_steps == 0:
                mixed = reference.mix_in_policy(self.mixup_alpha, parts())
                if mixed != trainable:  # a weight FSDP's units never yielded would stay unmixed
                    raise RuntimeError(
                        f"TR-DPO sync: trainable weights left unmixed: {sorted(trainable - mixed)[:3]}"
                    )
                if trainer.is_global_zero:  # every rank mixed the same weights: one line for all
                    log.info(
                        "TR-DPO: reference synced at step %d (alpha %g)",
                        trainer.global_step + 1,
                        self.mixup_alpha,
                    )

        self._hooks = [optimizer.register_step_post_hook(after_step) for optimizer in trainer.optimizers]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
