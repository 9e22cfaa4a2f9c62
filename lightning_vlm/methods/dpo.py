"""Offline preference optimisation (DPO and its loss family); MPO is this module with three weighted losses.

A step encodes each pair as two sequences sharing their prompt and images (one vision pass per
pair), sums answer log-probs under the policy and the reference, and hands them to the pure
``weighted_preference_loss``. The reference is a frozen copy, or the policy with its LoRA adapters
disabled; with ``precompute_ref_logps`` its log-probs are computed once before training, stored on
disk keyed by row content and model weights, and the frozen copy is then released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torchmetrics import MeanMetric

from lightning_vlm.callbacks.sigterm import raise_on_sigterm, sigterm_recorded
from lightning_vlm.counts import check_count
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.losses.preference import PreferenceInputs, RunningMean, weighted_preference_loss
from lightning_vlm.methods.common import (
    FactoryOptimized,
    greedy_answer_hits,
    message_text,
    turn_off_dropout,
)
from lightning_vlm.methods.completions import CompletionRecorder, answer_samples
from lightning_vlm.methods.preference_batch import encode_pairs, split_pairs
from lightning_vlm.methods.reference_cache import (
    ReferenceLogpCache,
    model_key,
    processor_fingerprint,
    weights_fingerprint,
)
from lightning_vlm.methods.reference_state import KeepsReference
from lightning_vlm.methods.step_window import StepWindow, WholeSteps, window_of
from lightning_vlm.methods.val_tokens import check_setting, resolve_val_max_new_tokens
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import (
    all_gather_object,
    all_reduce_sum,
    gather_cat,
    mean_normalizer,
    pooled_means,
    world_size,
)
from lightning_vlm.parallel.fsdp import sharded_root
from lightning_vlm.parallel.steps import RootCalls, partitions_weights, root_forward

log = logging.getLogger(__name__)

# Seconds between saves of the reference values during the precompute: a save (the whole file, under a
# lock) takes well under one at 100k rows, a batch of a 3B reference a fraction of one.
REF_SAVE_EVERY_S = 120.0


def chosen_answers(rows: list[dict]) -> list[str]:
    """The reference answers validation scores greedy generations against: each row's last chosen turn."""
    return [message_text(row["chosen"][-1]) for row in rows]


class DPO(KeepsReference, RootCalls, FactoryOptimized):
    """DPO with TRL's knobs: ``loss_type`` list, ``loss_weights``, ``beta``, ``label_smoothing``; and
    ``sft_normalization`` for the ``sft`` term ("per_example", ours, or TRL's "token_mean");
    ``bco_running_delta`` (``bco_pair``'s reward shift δ, the running mean of past implicit rewards as in
    BCO and MPO and TRL before 0.29; false: δ = 0, TRL 1.x)."""

    data_shape: ClassVar[str] = "preference"  # the rows it trains on (data=preference)

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        loss_type: Sequence[str] = ("sigmoid",),
        loss_weights: Sequence[float] | None = None,
        sft_normalization: str = "per_example",
        bco_running_delta: bool = True,
        precompute_ref_logps: bool = False,
        ref_cache_dir: str | None = None,
        one_vision_pass: bool = True,
        max_length: int | None = None,
        val_max_new_tokens: int | None = None,
        disable_dropout: bool = True,
    ) -> None:
        """``val_max_new_tokens=None``: the longest chosen answer of the validation set + a margin;
        ``disable_dropout`` (TRL's, on by default there too): the policy's dropout off, see
        ``methods.common.turn_off_dropout``."""
        super().__init__()
        check_setting(val_max_new_tokens)
        check_count("method.max_length", max_length, hint=" (tokens per sequence; null: no truncation)")
        if isinstance(loss_type, str):
            raise TypeError(
                f"loss_type must be a list of names, e.g. [{loss_type}], not the string {loss_type!r}"
            )
        loss_type = [str(t) for t in loss_type]
        if sft_normalization == "token_mean" and "sft" not in loss_type:
            raise ValueError(f"method.sft_normalization={sft_normalization!r} applies to the sft term, which "
                             f"loss_type {loss_type} does not have")  # fmt: skip
        if ref_cache_dir is not None and not precompute_ref_logps:
            raise ValueError(f"method.ref_cache_dir={ref_cache_dir!r} holds precomputed reference log-probs: set "
                             "method.precompute_ref_logps=true, or leave ref_cache_dir null")  # fmt: skip
        if not bco_running_delta and "bco_pair" not in loss_type:
            raise ValueError(f"method.bco_running_delta=false applies to the bco_pair term, which loss_type "
                             f"{loss_type} does not have")  # fmt: skip
        loss_weights = None if loss_weights is None else [float(w) for w in loss_weights]
        # Factories stay out of hparams: checkpoints then hold plain values and load with weights_only=True.
        self.save_hyperparameters(ignore=["vlm", "optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.hparams.update(loss_type=loss_type, loss_weights=loss_weights)
        # Fail at construction, naming the setting, rather than at the first training step.
        zeros = torch.zeros(1)
        _, probe = weighted_preference_loss(
            loss_type, loss_weights, PreferenceInputs(*([zeros] * 6)), beta, label_smoothing,
            sft_normalization=sft_normalization,
        )  # fmt: skip
        self.metric_names = [*probe, "loss"]
        self.vlm = vlm
        if disable_dropout:
            turn_off_dropout(vlm)
        self.ref: ReferenceModel | None = ReferenceModel(vlm)
        self.reference_fingerprint = self.ref.fingerprint  # kept when precomputing releases the copy
        self.generator = HFGenerator(vlm)
        self.bco_delta = RunningMean()  # BCO's δ: a buffer, so it is checkpointed
        self.step_window = StepWindow()
        self.whole_steps = WholeSteps()
        self.val_metrics = torch.nn.ModuleDict({self._slot(n): MeanMetric() for n in self.metric_names})
        self.val_answer_accuracy = MeanMetric()
        self.completion_recorder = CompletionRecorder()  # filled when LogCompletions asks
        self.val_new_tokens: int | None = None  # val_max_new_tokens, resolved at the first validation
        self.ref_cache: ReferenceLogpCache | None = None
        # The reference weights are the initial weights: fingerprint them before any step changes them.
        self._ref_fingerprint = weights_fingerprint(vlm.model) if precompute_ref_logps else None

    @staticmethod
    def _slot(name: str) -> str:
        return name.replace("/", "__")  # ModuleDict keys cannot hold "/" or "."

    # ---- reference ------------------------------------------------------------------------------------
    def training_reference(self) -> ReferenceModel | None:
        # Precomputed: training reads stored log-probs, and on_fit_start releases the copy.
        return None if self.hparams.precompute_ref_logps else self.ref

    def _cache(self) -> ReferenceLogpCache:
        if self.ref_cache is None:
            hp = self.hparams
            directory = hp.ref_cache_dir or Path(self.trainer.default_root_dir) / "ref_logps"
            # Precision (autocast) and the attention kernel change the values too (~1e-3 nats in bf16):
            # a cache filled under 32-true must not serve a bf16-mixed run.
            key = model_key(self.vlm.model_name_or_path, self._ref_fingerprint, max_length=hp.max_length,
                            processor=processor_fingerprint(self.vlm.processor),
                            precision=str(self.trainer.precision),
                            attention=self.vlm.model.config._attn_implementation)  # fmt: skip
            self.ref_cache = ReferenceLogpCache(directory, key, rank=self.global_rank)
        return self.ref_cache

    @torch.no_grad()
    def _compute_ref(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ref is None:
            raise RuntimeError(
                "the reference model was released after precomputing; a row is missing from the cache"
            )
        logps, _ = self.ref.token_logps(batch.inputs, batch.completion_mask)
        return split_pairs(logps.sum(dim=1))

    def _reference_logps(self, rows: list[dict], batch) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.hparams.precompute_ref_logps:
            return self._compute_ref(batch)
        cache = self._cache()
        missing = bool(cache.missing(rows))
        strategy = self.trainer.strategy if self._trainer is not None else None
        if strategy is not None and (
            sharded_root(strategy.model) is not None or partitions_weights(strategy)
        ):
            # A sharded model's forward (FSDP, ZeRO-3) is a collective (LoRA's reference is the policy):
            # every rank runs it, or none does, whichever rows each one still lacks.
            missing = bool(all_reduce_sum(torch.tensor(float(missing), device=self.device)) > 0)
        if missing:  # lazily, e.g. validate_before_fit runs before on_fit_start's precompute
            if self.ref is None:
                cache.get(rows)  # raises, naming the row
            else:
                cache.put(rows, *self._compute_ref(batch))
        chosen, rejected = cache.get(rows)
        return chosen.to(self.device, torch.float32), rejected.to(self.device, torch.float32)

    def on_validation_start(self) -> None:
        # validate_before_fit and eval.py validate before (or without) fit: the frozen copy, not a
        # registered submodule, follows the policy's device here too.
        if self.ref is not None:
            self.ref.to(self.device)
        if self.val_new_tokens is None:  # once per run (validations run every val_check_interval)
            self.val_new_tokens = resolve_val_max_new_tokens(
                self.hparams.val_max_new_tokens, self.trainer.datamodule, chosen_answers, self.vlm.tokenizer
            )

    def on_fit_start(self) -> None:
        if self.ref is not None:
            self.ref.to(self.device)
        if not self.hparams.precompute_ref_logps:
            return
        cache = self._cache()
        # Every rank computes a disjoint share of all rows, so together the ranks cover the rows any
        # of them will meet in any epoch (the shards of the shuffled order change every epoch). Hooks
        # run outside the precision context that steps get: enter it, so that under mixed precision
        # the stored values are what the live reference would give in a step (autocast), not fp32's.
        loaders = self.trainer.datamodule.shard_dataloaders(val=self.trainer.limit_val_batches != 0)
        with sigterm_recorded(self.trainer), self.trainer.precision_plugin.forward_context():
            self._precompute(cache, loaders)
        # Every rank takes the others' values (no shared filesystem or common run folder needed).
        for values in all_gather_object(cache.values):
            cache.values.update(values)
        # Every row's values are stored: the frozen copy is no longer needed (LoRA's costs nothing).
        self.ref = None

    def _precompute(self, cache: ReferenceLogpCache, loaders: list) -> None:
        """Every row of ``loaders`` into ``cache``, saved as it goes: a preemption or an error keeps the
        rows done (a pass over a large dataset takes hours), and a run that finds the folder again (a
        requeued job's, or ``ref_cache_dir``) computes only the rest."""
        saved = time.monotonic()
        try:
            for loader in loaders:
                for rows in loader:
                    # Under FSDP as a forward of the root module: a hook is outside the one a step gets.
                    root_forward(self, self._reference_logps, rows, self._encode(rows))
                    # Every rank at the same batch (the loaders are padded to one length): a collective.
                    raise_on_sigterm(self.trainer)
                    if time.monotonic() - saved >= REF_SAVE_EVERY_S:
                        cache.save()
                        saved = time.monotonic()
        except BaseException:
            cache.save()
            log.warning(
                "The reference precompute stopped: the values of %d rows are kept in %s, and a run that uses "
                "that folder again (ckpt_path=last in this run folder, or method.ref_cache_dir) computes only "
                "the rest", len(cache), cache.directory,
            )  # fmt: skip
            raise
        cache.save()

    # ---- steps ----------------------------------------------------------------------------------------
    def _encode(self, rows: list[dict]):
        hp = self.hparams
        batch = encode_pairs(self.vlm, rows, hp.max_length, hp.one_vision_pass)
        batch.inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.inputs.items()}
        batch.completion_mask = batch.completion_mask.to(self.device)
        return batch

    def _loss(self, rows: list[dict], train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        """This rank's loss, the metrics (in training over every rank's pairs) and how many pairs they cover."""
        hp = self.hparams
        batch = self._encode(rows)
        logps, _ = self.vlm.token_logps(batch.inputs, batch.completion_mask)
        chosen, rejected = split_pairs(logps.sum(dim=1))
        chosen_len, rejected_len = split_pairs(batch.completion_mask.sum(dim=1))
        ref_chosen, ref_rejected = self._reference_logps(rows, batch)
        inputs = PreferenceInputs(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)
        if "bco_pair" in hp.loss_type and hp.bco_running_delta and train:
            # δ tracks the mean implicit reward over all ranks' pairs seen so far (BCO's and MPO's moving
            # average; TRL's RunningMoments until 0.29, gone in TRL 1.x, which bco_running_delta=false matches).
            rewards = hp.beta * torch.cat([chosen - ref_chosen, rejected - ref_rejected]).detach()
            self.bco_delta.update(gather_cat(rewards))
        sft_tokens = None
        if train and hp.sft_normalization == "token_mean":
            # TRL's token mean over every rank's chosen tokens: the loss is rescaled by pairs below, so
            # the normaliser carries the inverse of that factor (see losses.preference.sft_nll_loss).
            pairs = torch.tensor(float(len(rows)), device=chosen.device)
            sft_tokens = mean_normalizer(chosen_len.sum()) * pairs / mean_normalizer(pairs)
        loss, metrics = weighted_preference_loss(
            hp.loss_type, hp.loss_weights, inputs, hp.beta, hp.label_smoothing,
            self.bco_delta.mean if hp.bco_running_delta else 0.0, hp.sft_normalization, sft_tokens,
        )  # fmt: skip
        metrics["loss"] = loss.detach()
        covered = float(len(rows))
        if train:
            # Every term is a mean over pairs: rescale this rank's mean so that DDP's gradient average
            # is the mean over all ranks' pairs, also when ranks hold different numbers of them.
            pairs = torch.tensor(float(len(rows)), device=loss.device)
            per_rank = mean_normalizer(pairs)
            loss = loss * pairs / per_rank
            covered = float(per_rank) * world_size()
            # Every metric is a mean over pairs too: the step's values over all ranks' pairs, as one
            # process logs them. Validation pools its epoch means over pairs through torchmetrics
            # instead; there a token_mean sft term is each batch's own token mean, so its epoch value
            # depends on how rows fall into batches (a little, on N processes).
            metrics = pooled_means(metrics, len(rows))
        return loss, metrics, covered

    def training_step(self, rows: list[dict], batch_idx: int) -> torch.Tensor:
        loss, metrics, pairs = self._loss(rows, train=True)
        # Over the step's micro-batches too (accumulate_grad_batches), each weighing its pairs.
        metrics = self.step_window.update(window_of(self, batch_idx), metrics, pairs)
        for name, value in metrics.items():
            show = name in ("loss", "rewards/accuracies")
            self.log(
                f"train/{name}", value, on_step=True, on_epoch=False, prog_bar=show, batch_size=len(rows)
            )
        return loss * self.whole_steps.scale(self, batch_idx)  # an epoch's short last step: a whole one

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        _, metrics, _ = self._loss(rows, train=False)
        for name, value in metrics.items():
            metric = self.val_metrics[self._slot(name)]
            metric.update(value, weight=len(rows))
            self.log(f"val/{name}", metric, prog_bar=name == "rewards/accuracies", batch_size=len(rows))
        references = chosen_answers(rows)
        rollouts, hits = greedy_answer_hits(self.generator, rows, references, self.val_new_tokens)
        self.val_answer_accuracy.update(torch.tensor(hits, device=self.device))
        if self.completion_recorder.wants("val"):
            samples = answer_samples(rows, rollouts.completion_texts, references, hits)
            self.completion_recorder.record("val", samples)
        self.log("val/answer_accuracy", self.val_answer_accuracy, prog_bar=True, batch_size=len(rows))

    def on_train_epoch_end(self) -> None:
        if self.ref_cache is not None:
            self.ref_cache.save()
