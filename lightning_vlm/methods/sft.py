"""Supervised fine-tuning of a VLM on conversations: loss on assistant tokens only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torchmetrics import MeanMetric

from lightning_vlm.counts import check_count
from lightning_vlm.data.lookahead import LookaheadBatch
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.losses.sft import sft_loss, token_accuracy
from lightning_vlm.methods.common import (
    FactoryOptimized,
    answer_accuracy_rows,
    greedy_answer_hits,
)
from lightning_vlm.methods.completions import CompletionRecorder, answer_samples
from lightning_vlm.methods.step_tokens import StepTokens
from lightning_vlm.methods.step_window import StepWindow, window_of
from lightning_vlm.methods.val_tokens import check_setting, resolve_val_max_new_tokens
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import all_reduce_sum


class SFT(FactoryOptimized):
    """SFT: NLL of the assistant turns; validation also scores held-out answers by greedy generation."""

    data_shape: ClassVar[str] = "sft"  # the rows it trains on (data=sft: SFTDataModule)

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        max_length: int | None = None,
        val_max_new_tokens: int | None = None,
    ) -> None:
        """``val_max_new_tokens=None``: the longest validation answer + a margin (see ``val_tokens``)."""
        super().__init__()
        check_setting(val_max_new_tokens)
        check_count("method.max_length", max_length, hint=" (tokens per sequence; null: no truncation)")
        # Factories stay out of hparams: checkpoints then hold plain values and load with weights_only=True.
        self.save_hyperparameters(ignore=["vlm", "optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.vlm = vlm
        self.generator = HFGenerator(vlm)
        self.train_token_accuracy = MeanMetric()
        self.step_window = StepWindow()
        self.step_tokens = StepTokens(self._encode)
        self.val_loss = MeanMetric()
        self.val_token_accuracy = MeanMetric()
        self.val_answer_accuracy = MeanMetric()
        self.completion_recorder = CompletionRecorder()  # filled when LogCompletions asks
        self.val_new_tokens: int | None = None  # val_max_new_tokens, resolved at the first validation

    def _nll_and_accuracy(
        self, inputs: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token log-probs, target mask, correct target tokens, target tokens) of encoded rows."""
        inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        labels = inputs.pop("labels")
        mask = labels != -100
        logps, _, argmax = self.vlm.token_logps(inputs, mask, return_argmax=True)
        correct, total = token_accuracy(argmax, labels, mask)
        return logps, mask, correct, total

    def _encode(self, rows: list[dict]) -> dict:
        return self.vlm.encode_sft(rows, max_length=self.hparams.max_length)

    def training_step(self, batch: LookaheadBatch | list[dict], batch_idx: int) -> torch.Tensor:
        rows = batch.rows if isinstance(batch, LookaheadBatch) else batch
        inputs, step_tokens = self.step_tokens.take(self, batch, batch_idx)
        logps, mask, correct, total = self._nll_and_accuracy(inputs)
        # The step's token mean over every rank's rows and every micro-batch (TRL's num_items_in_batch): each
        # rank divides its sum by the step's tokens per rank (DDP averages ranks), and the factor undoes
        # Lightning's division of each micro-batch by accumulate_grad_batches (see step_tokens).
        loss = sft_loss(logps, mask, step_tokens) * self.trainer.accumulate_grad_batches
        # The micro-batch's values over every rank's tokens, as one process logs them (one all-reduce). Every
        # rank feeds the same accuracy, so the epoch value torchmetrics syncs stays the token-weighted mean.
        nll = sft_loss(logps.detach(), mask, 1.0)  # the sum: a divisor of 1
        sums = all_reduce_sum(torch.stack([nll.float(), correct.float(), total.float()]))
        accuracy = sums[1] / sums[2].clamp(min=1)
        self.train_token_accuracy.update(accuracy, weight=sums[2])
        # Over the step's micro-batches too (accumulate_grad_batches), weighted by their tokens.
        step = self.step_window.update(
            window_of(self, batch_idx),
            {"loss": sums[0] / sums[2].clamp(min=1), "token_accuracy": accuracy},
            float(sums[2]),
        )
        for name, value in step.items():
            self.log(f"train/{name}", value, prog_bar=True, batch_size=len(rows))
        self.log("train/token_accuracy_epoch", self.train_token_accuracy, on_step=False, on_epoch=True,
                 batch_size=len(rows))  # fmt: skip
        return loss

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        logps, mask, correct, total = self._nll_and_accuracy(self._encode(rows))
        loss = sft_loss(logps, mask)
        self.val_loss.update(loss, weight=total)
        self.val_token_accuracy.update(correct / total.clamp(min=1), weight=total)
        prompts, references = answer_accuracy_rows(rows)
        rollouts, hits = greedy_answer_hits(self.generator, prompts, references, self.val_new_tokens)
        self.val_answer_accuracy.update(torch.tensor(hits, device=self.device))
        if self.completion_recorder.wants("val"):
            samples = answer_samples(prompts, rollouts.completion_texts, references, hits)
            self.completion_recorder.record("val", samples)
        self.log("val/loss", self.val_loss, batch_size=len(rows))
        self.log("val/token_accuracy", self.val_token_accuracy, batch_size=len(rows))
        self.log("val/answer_accuracy", self.val_answer_accuracy, prog_bar=True, batch_size=len(rows))

    def on_validation_start(self) -> None:
        if self.val_new_tokens is None:  # once per run (validations run every val_check_interval)
            self.val_new_tokens = resolve_val_max_new_tokens(
                self.hparams.val_max_new_tokens, self.trainer.datamodule,
                lambda rows: answer_accuracy_rows(rows)[1], self.vlm.tokenizer,
            )  # fmt: skip
