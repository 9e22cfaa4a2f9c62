"""KTO (Ethayarajh et al. 2024) for VLMs: unpaired desirable / undesirable answers, TRL's loss and defaults.

Each row is also encoded with its *mismatched* completion (the previous row's answer in the batch over
all ranks, TRL's rotation by one, skipping rows of the same prompt, which TRL does not;
``mismatched_completions``): two batches of B sequences over the same prompts and images
(``preference_batch.encode_columns``). The matched one runs with autograd; the mismatched one, whose
detached mean alone enters the loss, without, as TRL's KL pass (half the activations and backward work
of one forward over 2B), and takes the image features the matched forward encoded, so the vision tower
runs once per row (``KTO._answer_logps``).
The matched answer gives the implicit reward r = logπ - logπ_ref; the mismatched ones, over every
rank's rows, give the reference point z0. TRL's text path fixes each row's partner once at
preprocessing, and its vision collator cycles within each device's batch; here the rotation runs over
the global batch, so N processes pair rows as one process does, and every shuffled epoch sees new
mismatched pairs. The reference is a frozen copy, or the policy with its LoRA adapters disabled
(``ReferenceModel``). Reference log-probs are not precomputed: the mismatched pairs change every batch,
and TRL refuses ``precompute_ref_log_probs`` for vision data too. ``apo_zero_unpaired`` has no
reference point: each row is encoded alone (B sequences, not 2B), as TRL skips its KL pass there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torchmetrics import MeanMetric

from lightning_vlm.counts import check_count
from lightning_vlm.generation.hf import HFGenerator
from lightning_vlm.losses.kto import (
    KTO_LOSS_TYPES,
    kto_losses,
    kto_metrics,
    kto_reference_point,
    kto_weight_advice,
)
from lightning_vlm.methods.common import (
    FactoryOptimized,
    greedy_answer_hits,
    message_text,
    turn_off_dropout,
)
from lightning_vlm.methods.completions import CompletionRecorder, answer_samples
from lightning_vlm.methods.preference_batch import PairBatch, encode_columns
from lightning_vlm.methods.reference_cache import prompt_key
from lightning_vlm.methods.reference_state import KeepsReference
from lightning_vlm.methods.step_window import StepWindow, WholeSteps, window_of
from lightning_vlm.methods.val_tokens import check_setting, resolve_val_max_new_tokens
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.vision_cache import with_encoded_images
from lightning_vlm.models.vision_every_rank import reusing_encoded_images
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import all_gather_object, gather_cat, mean_normalizer, rank

log = logging.getLogger(__name__)
# Validation means over the epoch; rewards/margins is their chosen minus rejected (on_validation_epoch_end).
METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


def metric_weight(name: str, desirable: int, undesirable: int) -> int:
    """How many items a batch's value of metric ``name`` is a mean over, so the epoch mean is over items
    (TRL's sums and counts): desirable rows for ``*/chosen``, undesirable for ``*/rejected``, the
    (desirable, undesirable) pairs for ``rewards/accuracies``, rows otherwise."""
    if name.endswith("/chosen"):
        return desirable
    if name.endswith("/rejected"):
        return undesirable
    return desirable * undesirable if name == "rewards/accuracies" else desirable + undesirable


@runtime_checkable
class LabeledData(Protocol):
    """Training data that can count its labels (``UnpairedDataModule``)."""

    def label_counts(self) -> tuple[int, int]:
        """(desirable, undesirable) training rows."""
        ...


def reference_answers(rows: list[dict]) -> list[str | None]:
    """What greedy answers are scored against: the row's ``solution``, else a desirable completion."""
    out: list[str | None] = []
    for row in rows:
        if row.get("solution") is not None:
            out.append(str(row["solution"]))
        else:
            out.append(message_text(row["completion"][-1]) if row["label"] else None)
    return out


def mismatched_completions(rows: list[dict]) -> list[Any] | None:
    """Each row's mismatched answer for z0: the completion of the nearest row before it in the step's
    batch over all ranks (cyclically, TRL's rotation by one) that asks another question; None when that
    batch holds a single row.

    z0 estimates KL(π‖π_ref) from answers to *other* prompts. Paired data read as unpaired rows puts a
    pair's two answers next to each other (so does data listing several answers per prompt), and a plain
    rotation would hand half the rows their own prompt's other answer, biasing z0 (always so without
    shuffling, e.g. in validation). Such neighbours are skipped; a batch of one prompt has no other
    answer and keeps the rotation. Rank r's rows sit at positions r, r + N, r + 2N, ... of the global
    batch (the data's sharding: one process with N times the batch sees the same rows in that order), so
    N processes pair rows exactly as one process does and z0 is the same. Prompt digests and completions
    (text, not tensors) are exchanged each step.
    """
    per_rank = all_gather_object([(prompt_key(r), r["completion"]) for r in rows])
    order = [
        (r, i) for i in range(max(map(len, per_rank))) for r in range(len(per_rank)) if i < len(per_rank[r])
    ]
    if len(order) < 2:
        return None
    flat = [per_rank[r][i] for r, i in order]

    def other(p: int) -> Any:
        before = [(p - k) % len(flat) for k in range(1, len(flat))]
        q = next((q for q in before if flat[q][0] != flat[p][0]), before[0])
        return flat[q][1]

    position = {at: p for p, at in enumerate(order)}
    me = rank()
    return [other(position[me, i]) for i in range(len(rows))]


def desirable_answers(rows: list[dict]) -> list[str]:
    """Answer texts whose length sets the validation generation length."""
    return [a for a in reference_answers(rows) if a is not None] or [""]


class KTO(KeepsReference, FactoryOptimized):
    """KTO with TRL's knobs: ``beta``, ``desirable_weight``, ``undesirable_weight``, ``loss_type``."""

    data_shape: ClassVar[str] = "unpaired"  # the rows it trains on (data=unpaired; pairs are unpaired)

    def __init__(
        self,
        vlm: VLM,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        loss_type: str = "kto",
        one_vision_pass: bool = True,
        max_length: int | None = None,
        val_max_new_tokens: int | None = None,
        disable_dropout: bool = True,
    ) -> None:
        super().__init__()
        check_setting(val_max_new_tokens)
        check_count("method.max_length", max_length, hint=" (tokens per sequence; null: no truncation)")
        if loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"method.loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
        if not beta > 0 or desirable_weight < 0 or undesirable_weight < 0:
            raise ValueError(
                f"need beta > 0 and weights >= 0, got beta={beta}, desirable_weight={desirable_weight}, "
                f"undesirable_weight={undesirable_weight}"
            )
        self.save_hyperparameters(ignore=["vlm", "optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.vlm = vlm
        if disable_dropout:  # TRL's, on by default there too (methods.common.turn_off_dropout)
            turn_off_dropout(vlm)
        self.ref = ReferenceModel(vlm)
        self.reference_fingerprint = self.ref.fingerprint  # checkpoints record it (callbacks/run_identity.py)
        self.generator = HFGenerator(vlm)
        self.val_metrics = torch.nn.ModuleDict({n.replace("/", "__"): MeanMetric() for n in METRICS})
        self.val_answer_accuracy = MeanMetric()
        self.completion_recorder = CompletionRecorder()  # filled when LogCompletions asks
        self.val_new_tokens: int | None = None
        self.step_window = StepWindow()
        self.whole_steps = WholeSteps()

    def _loss(
        self, rows: list[dict], train: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """This rank's loss, the metrics over every rank's rows, and those rows' labels (bool [B_all])."""
        hp = self.hparams
        logps, ref, z0 = self._logps_and_reference_point(rows)
        desirable = torch.tensor([bool(r["label"]) for r in rows], device=self.device)
        logratios = logps - ref
        losses = kto_losses(logratios, desirable, z0, hp.beta, hp.desirable_weight, hp.undesirable_weight,
                            hp.loss_type)  # fmt: skip
        loss = losses.mean()
        if train:
            # Rescale this rank's mean so DDP's gradient average is the mean over all ranks' rows.
            n = torch.tensor(float(len(rows)), device=loss.device)
            loss = loss * n / mean_normalizer(n)
        # Metrics over every rank's rows, as one process computes them (TRL gathers them too). The ranking
        # accuracy pairs rows across ranks (a rank may hold only one label: the data's labels alternate,
        # and rank r takes every N-th row), so the rows themselves are gathered, in one collective.
        columns = [logratios, logps, desirable, losses]  # float32: one dtype to stack, whatever the precision
        every = gather_cat(torch.stack([c.detach().float() for c in columns], dim=1))
        labels = every[:, 2].bool()
        metrics = kto_metrics(every[:, 0], labels, z0, hp.beta, every[:, 1])
        metrics["loss"] = every[:, 3].mean()
        return loss, metrics, labels

    def _logps_and_reference_point(
        self, rows: list[dict]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Policy and reference log-probs of each row's answer [B], and z0 (None for apo_zero_unpaired,
        whose loss has no reference point: it skips the mismatched pass and its collectives, as TRL does)."""
        hp = self.hparams
        with_z0 = hp.loss_type != "apo_zero_unpaired"
        # Row i with an earlier row's completion to another prompt (TRL's rotation): the answer for z0.
        mismatched = mismatched_completions(rows) if with_z0 else None
        # A single row over all ranks fills the slot with its own answer; its KL is dropped below.
        others = mismatched if mismatched is not None else [r["completion"] for r in rows]
        pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": other,
                  "images": r.get("images", [])} for r, other in zip(rows, others, strict=True)]  # fmt: skip
        if not with_z0:
            [(logps, ref)] = self._answer_logps(*encode_columns(self.vlm, pairs, hp.max_length, ("chosen",)))
            return logps, ref, None
        (logps, ref), (kl_logps, kl_ref) = self._answer_logps(
            *encode_columns(self.vlm, pairs, hp.max_length, ("chosen", "rejected"))
        )
        kl = kl_logps - kl_ref
        if mismatched is None:
            # A batch of one row over all ranks (an epoch's last) has no mismatched answer: its own would
            # make z0 the reward itself. It adds nothing to z0 (0), and never raises: under DDP the other
            # ranks would then wait in the gather below.
            log.warning("KTO: a batch of one row adds nothing to the reference point z0")
            kl = kl[:0]
        # Over every rank's rows (a collective on every step, validation included).
        return logps, ref, kto_reference_point(gather_cat(kl))

    def _answer_logps(self, *batches: PairBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(policy, reference) summed log-probs [B] of each row's answer, for batches of the same rows.

        The first batch runs with autograd; the others (KTO's KL half, whose detached mean alone enters the
        loss) without, as TRL's KL pass, so activations are kept and backpropagated for B sequences, not 2B.
        With ``one_vision_pass`` each model's vision tower runs once, on the first batch's images just before
        its forward, and every batch takes those features; otherwise each forward runs the tower itself, as
        TRL's do.
        """
        shared = self.hparams.one_vision_pass
        scorers = (
            (self.vlm.token_logps, self.vlm.encoded_images),
            (self.ref.token_logps, self.ref.encoded_images),
        )
        loaded = [({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in b.inputs.items()},
                   b.completion_mask.to(self.device)) for b in batches]  # fmt: skip

        def run(score: Callable, inputs: dict, mask: torch.Tensor, images: dict | None) -> torch.Tensor:
            return score(inputs if images is None else with_encoded_images(inputs, images), mask)[0].sum(
                dim=1
            )

        # Each model encodes and runs the first batch before the next model starts: under FSDP every rank
        # must run the towers and decoders in one order, and a text-only rank runs its blank vision pass
        # inside the decoder's forward (models/vision_every_rank.py).
        first, encoded = [], []
        for score, encode in scorers:
            encoded.append(encode(loaded[0][0]) if shared else None)
            first.append(run(score, *loaded[0], encoded[-1]))
        with torch.no_grad(), reusing_encoded_images() if shared else contextlib.nullcontext():
            rest = [
                tuple(
                    run(score, inputs, mask, images)
                    for (score, _), images in zip(scorers, encoded, strict=True)
                )
                for inputs, mask in loaded[1:]
            ]
        return [(first[0], first[1]), *rest]

    def training_step(self, rows: list[dict], batch_idx: int) -> torch.Tensor:
        loss, metrics, labels = self._loss(rows, train=True)
        # Over the step's micro-batches too (accumulate_grad_batches), each mean weighing its items; the
        # margin is then the step's chosen mean minus its rejected mean. A metric without items (a batch
        # without one of the labels) is left out.
        counts = int(labels.sum()), int((~labels).sum())
        metrics.pop("rewards/margins")
        metrics = self.step_window.update(
            window_of(self, batch_idx), metrics, {name: metric_weight(name, *counts) for name in metrics}
        )
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        for name, value in metrics.items():
            if not torch.isnan(value):  # a diverged value: KTO has never logged NaN
                self.log(f"train/{name}", value, on_step=True, on_epoch=False, batch_size=len(rows),
                         prog_bar=name in ("loss", "rewards/accuracies"))  # fmt: skip
        return loss * self.whole_steps.scale(self, batch_idx)  # an epoch's short last step: a whole one

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        # Every rank updates with the same values over all ranks' rows, so the synced epoch means are those
        # of the one-process run.
        _, metrics, labels = self._loss(rows, train=False)
        desirable, undesirable = int(labels.sum()), int((~labels).sum())
        for name in METRICS:
            if name not in metrics:  # kl under apo_zero_unpaired: not estimated
                continue
            metric, value = self.val_metrics[name.replace("/", "__")], metrics[name]
            if not torch.isnan(value):  # NaN: this batch has none of the rows the metric is over
                metric.update(value, weight=metric_weight(name, desirable, undesirable))
            self.log(f"val/{name}", metric, prog_bar=name == "rewards/accuracies", batch_size=len(rows))
        references = reference_answers(rows)
        rollouts, hits = greedy_answer_hits(self.generator, rows, references, self.val_new_tokens)
        self.val_answer_accuracy.update(torch.tensor(hits, device=self.device))
        if self.completion_recorder.wants("val"):
            samples = answer_samples(rows, rollouts.completion_texts, references, hits)
            self.completion_recorder.record("val", samples)
        self.log("val/answer_accuracy", self.val_answer_accuracy, prog_bar=True, batch_size=len(rows))

    def on_validation_epoch_end(self) -> None:
        # The epoch's margin is its chosen mean minus its rejected mean, not a mean of batch margins (a
        # batch with one kind of row has none). Lightning has computed, and all ranks synced, both already.
        chosen, rejected = (self.val_metrics[f"rewards__{kind}"].compute() for kind in ("chosen", "rejected"))
        self.log("val/rewards/margins", chosen - rejected, sync_dist=True)

    def on_validation_start(self) -> None:
        self.ref.to(self.device)  # the frozen copy is not a submodule: it follows the policy by hand
        if self.val_new_tokens is None:
            self.val_new_tokens = resolve_val_max_new_tokens(
                self.hparams.val_max_new_tokens,
                self.trainer.datamodule,
                desirable_answers,
                self.vlm.tokenizer,
            )

    def on_fit_start(self) -> None:
        self.ref.to(self.device)
        self.check_weights(self.trainer.datamodule)
        rows = getattr(self.trainer.datamodule, "hparams", {}).get("batch_size")
        if self.hparams.loss_type == "kto" and isinstance(rows, int) and rows * self.trainer.world_size < 2:
            # z0 is estimated from other rows' answers in the step's batch: one row has none, and every
            # step would train with z0 = 0, a different loss (TRL refuses this too).
            raise ValueError(
                f"KTO's reference point z0 needs at least 2 rows a step over all processes, but data.batch_size="
                f"{rows} on {self.trainer.world_size} process(es) gives {rows * self.trainer.world_size}: raise "
                "data.batch_size (lower model memory with method.max_length or LoRA), or use "
                "loss_type=apo_zero_unpaired, which has no z0"
            )

    def check_weights(self, data: object) -> str | None:
        """Warns (rank 0) when the weights do not suit the training data's label balance; returns why."""
        if not isinstance(data, LabeledData) or rank() != 0:  # every rank holds the same data
            return None
        advice = kto_weight_advice(*data.label_counts(), self.hparams.desirable_weight,
                                   self.hparams.undesirable_weight)  # fmt: skip
        if advice is not None:
            log.warning("KTO: %s", advice)
        return advice
