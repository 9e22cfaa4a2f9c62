"""Pieces every method shares: optimizer/scheduler wiring, turning conversations into prompts, and the
held-out answer accuracy by greedy generation."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch

from lightning_vlm.generation.base import Generator, Rollouts, SamplingSettings
from lightning_vlm.methods.skipped_steps import SkippedStepsHoldSchedule
from lightning_vlm.rewards.accuracy import answers_match

log = logging.getLogger(__name__)


def configure_optimizers(
    module: L.LightningModule,
    optimizer: Callable[..., torch.optim.Optimizer],
    scheduler: Callable[..., Any] | None = None,
) -> Any:
    """Completes the `_partial_` optimizer (and scheduler) nodes with the trainable parameters."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: is everything frozen (vision tower, LoRA settings)?")
    opt = optimizer(params=params)
    _warn_half_precision_updates(params, opt)
    if scheduler is None:
        return opt
    sched = scheduler(optimizer=opt)
    # Lightning checks this only where lr_scheduler_step is not overridden (SkippedStepsHoldSchedule does).
    lr = torch.optim.lr_scheduler
    if isinstance(sched, lr.ReduceLROnPlateau) or not isinstance(sched, lr.LRScheduler):
        raise ValueError(
            f"method.scheduler built a {type(sched).__name__}, not a torch.optim.lr_scheduler.LRScheduler "
            "stepped once per optimizer step (ReduceLROnPlateau, which needs a metric, is not one)"
        )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def clip_gradients(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    value: float | None,
    algorithm: str | None = "norm",
) -> None:
    """Lightning's gradient clipping, which FSDP cannot do by norm: there the root FSDP module's own
    ``clip_grad_norm_`` computes the norm over every rank's shard (a collective; all ranks call it)."""
    if not value:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = module.trainer.strategy.model
    if isinstance(model, FullyShardedDataParallel) and (algorithm or "norm") == "norm":
        model.clip_grad_norm_(value)
        return
    module.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)


DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout)  # fmt: skip


def turn_off_dropout(model: torch.nn.Module) -> None:
    """Sets every dropout module of ``model`` (LoRA's ``lora_dropout`` too) to p = 0, as TRL's
    ``disable_dropout``. The loss compares the policy's log-probs with the
    reference's, which runs without dropout: under dropout the policy's are noisy, and the implicit
    rewards (DPO), z0 (KTO) or ratios with them. Attention dropout that a model applies as a float of
    its config, not a module, is left as is (TRL leaves it too)."""
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = 0.0


class FactoryOptimized(SkippedStepsHoldSchedule):
    """The optimizer hooks of the methods Lightning optimises itself (SFT, DPO, KTO): the optimizer and
    scheduler from their Hydra ``_partial_`` factories, FSDP-aware gradient clipping, and a schedule that
    fp16 steps skipped for overflow do not advance."""

    optimizer_factory: Callable[..., torch.optim.Optimizer]
    scheduler_factory: Callable[..., Any] | None

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(self, self.optimizer_factory, self.scheduler_factory)

    def on_train_start(self) -> None:
        warn_steps_across_epochs(self.trainer)


def warn_steps_across_epochs(trainer: L.Trainer) -> None:
    """Warns when DeepSpeed's optimizer steps will straddle epochs. Its engine steps every
    ``accumulate_grad_batches`` micro-batches counted over the whole run, while Lightning and the methods
    close a step at each epoch's end (SFT's token count, DPO's and KTO's short last step): where an epoch's
    batches are no multiple of k, the engine's steps mix two epochs' windows, each normalised as its own."""
    k, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
    if trainer.strategy.handles_gradient_accumulation and k > 1 and batches != float("inf") and batches % k:
        log.warning(
            "DeepSpeed with trainer.accumulate_grad_batches=%d and %d batches an epoch: its optimizer steps "
            "cross epoch ends, so their loss normalisation is not the whole step's; choose data.batch_size "
            "(or trainer.limit_train_batches) so an epoch has a multiple of %d batches",
            k, batches, k,
        )  # fmt: skip


def _warn_half_precision_updates(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
    # bf16 keeps 8 significant bits: an update below ~0.4% of a weight rounds away, so a 1e-6 AdamW
    # step on bf16 weights silently does nothing. fp32 master weights (model.dtype=float32 with
    # trainer.precision=bf16-mixed) keep it; LoRA adapters are fp32 already.
    half = sum(p.numel() for p in params if p.dtype in (torch.bfloat16, torch.float16))
    lr = max(group["lr"] for group in opt.param_groups)
    if half and lr < 1e-4:
        log.warning(
            "%d trainable parameters are stored in half precision with lr=%g: most updates will round "
            "away. Load the model in float32 (model.dtype=float32) and train with trainer.precision="
            "bf16-mixed, or train LoRA adapters.",
            half,
            lr,
        )


def message_text(message: dict) -> str:
    """The concatenated text blocks of one chat message."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(block.get("text") or "" for block in content if block.get("type") == "text")


def answer_accuracy_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Splits SFT rows into prompt rows (all turns before the last assistant turn) and reference answers."""
    prompts, references = [], []
    for i, row in enumerate(rows):
        messages = row["messages"]
        last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ValueError(f"row {i}: no assistant message to score against")
        prompts.append({**row, "prompt": messages[:last]})
        references.append(message_text(messages[last]))
    return prompts, references


def greedy_answer_hits(
    generator: Generator, rows: list[dict], references: Sequence[Any], max_new_tokens: int
) -> tuple[Rollouts, list[float]]:
    """Greedy answers to ``rows`` (one each), and 1.0 or 0.0 (``answers_match``) for every row whose
    reference is not None, in row order: ``val/answer_accuracy`` of every method (SFT, DPO, online)."""
    greedy = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0, do_sample=False)
    rollouts = generator.generate(rows, 1, greedy)
    texts = rollouts.completion_texts
    hits = [float(answers_match(t, r)) for t, r in zip(texts, references, strict=True) if r is not None]
    return rollouts, hits
