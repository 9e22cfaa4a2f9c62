"""What a checkpoint was written by: the method's class and the reference model it trained against.

Lightning restores any checkpoint whose weight names fit the module, so an SFT checkpoint resumed as
GRPO continued silently with SFT's optimizer state and step. A frozen-copy reference (DPO, KTO, online
methods with a KL) is not in the checkpoint: a resume or an evaluation rebuilds it from
``model.model_name_or_path``, and another model there changed every reference log-prob without a sign.
(After TR-DPO's syncs the checkpoint holds the moved copy too, ``methods/reference_state.py``, loaded over
the rebuilt one: the fingerprint stays the initial weights', so the check below still applies.)
``RunIdentity`` records both in every checkpoint train.py writes; ``check_run_identity`` refuses a
checkpoint whose record (in its ``checkpoint_entries``) differs from the run about to load it (checkpoints
without one load as before).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import lightning as L
from lightning.pytorch.callbacks import Timer
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_vlm.models.reference import same_weights

log = logging.getLogger(__name__)

KEY = "lightning_vlm/run_identity"
EXPORT_ADVICE = (
    "to start another method from its weights, export them (callbacks=[default,export]) and pass "
    "model.model_name_or_path=<that folder>"
)


@runtime_checkable
class HasReference(Protocol):
    """A method with a reference model: a sample of its frozen copy's weights (``ReferenceModel``), None
    when the reference is the policy with its adapters off (LoRA: its weights are in the checkpoint)."""

    reference_fingerprint: dict[str, Any] | None


def _identity(module: L.LightningModule) -> dict[str, Any]:
    cls = type(module)
    fingerprint = module.reference_fingerprint if isinstance(module, HasReference) else None
    return {"method": f"{cls.__module__}.{cls.__qualname__}", "reference": fingerprint}


class RunIdentity(L.Callback):
    """Writes the method's class and its reference's fingerprint into every checkpoint (``KEY``)."""

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[KEY] = _identity(pl_module)


def check_run_identity(
    ckpt_path: str | None, entries: Mapping[str, Any], module: L.LightningModule, model_name_or_path: str
) -> None:
    """Refuses ``ckpt_path`` (whose ``checkpoint_entries`` are ``entries``) when another method wrote it, or
    when its reference model's weights are not the ones this run built from ``model_name_or_path``, naming
    what to pass instead."""
    recorded = entries.get(KEY)
    if not isinstance(recorded, dict):
        return
    ours = _identity(module)
    if recorded.get("method") != ours["method"]:
        written = str(recorded.get("method")).rsplit(".", 1)[-1]
        raise ValueError(
            f"ckpt_path={ckpt_path!r} was written by {written}, and this run's method is "
            f"{type(module).__name__}: a checkpoint resumes, or is scored by, the method that wrote it (its "
            f"optimizer state and step come with it). Pass that run's method=, or {EXPORT_ADVICE}."
        )
    theirs = recorded.get("reference")
    if (
        isinstance(theirs, dict)
        and ours["reference"] is not None
        and not same_weights(theirs, ours["reference"])
    ):
        raise ValueError(
            f"ckpt_path={ckpt_path!r} was trained against a reference model with other weights than this "
            f"run's, a frozen copy of model.model_name_or_path={model_name_or_path!r}: the reference "
            "log-probs, and the rewards, KL and preference accuracy from them, would differ from training's. "
            "Pass the training run's model.model_name_or_path (and tiny_start)."
        )


def warn_unapplied_optimizer(
    ckpt_path: str | None, entries: Mapping[str, Any], optimizer: Mapping[str, Any] | None
) -> None:
    """Warns, naming them, of ``method.optimizer`` settings that differ from those ``ckpt_path``'s optimizer
    was built with: Lightning restores its state, param groups included, so a resume keeps the
    checkpoint's lr, weight decay, betas and eps. Without a scheduler only: schedulers rewrite the lr and
    some the betas (OneCycleLR's, CyclicLR's), so stored values would differ from the settings unchanged.
    Sharded (FSDP, DeepSpeed) checkpoints keep their optimizer state apart, which ``entries`` lack."""
    groups = [g for state in entries.get("optimizer_states") or [] for g in state.get("param_groups") or []]
    if not groups or entries.get("lr_schedulers") or not isinstance(optimizer, Mapping):
        return
    stored = groups[0]
    differ = {
        key: (value, stored[key])
        for key, value in optimizer.items()
        if not key.startswith("_") and key in stored and _as_json(value) != _as_json(stored[key])
    }
    if differ:
        log.warning(
            "ckpt_path=%r restores its optimizer state, so these settings are not applied: %s. The resumed "
            "run trains on with the checkpoint's.",
            ckpt_path,
            ", ".join(
                f"method.optimizer.{k}={ours!r} (checkpoint: {theirs!r})"
                for k, (ours, theirs) in differ.items()
            ),
        )


@runtime_checkable
class FactoryBuilt(Protocol):
    """A method whose optimizer and scheduler come from Hydra ``_partial_`` factories (every method here)."""

    optimizer_factory: Any
    scheduler_factory: Any


# A scheduler's progress, restored as it should be; everything else in its state is a setting.
_SCHEDULE_PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial",
                      "best", "num_bad_epochs", "cooldown_counter"}  # fmt: skip


def _schedule_settings(state: Any) -> Any:
    """A scheduler's ``state_dict`` without its progress (nested schedulers' too: SequentialLR's)."""
    if isinstance(state, Mapping):
        return {k: _schedule_settings(v) for k, v in state.items() if k not in _SCHEDULE_PROGRESS}
    if isinstance(state, list | tuple):
        return [_schedule_settings(v) for v in state]
    return state


def warn_unapplied_scheduler(ckpt_path: str | None, entries: Mapping[str, Any], module: Any) -> None:
    """Warns, naming them, of ``method.scheduler`` settings (and through its ``base_lrs``, the optimizer's lr)
    that differ from those ``ckpt_path``'s scheduler was built with: Lightning restores a scheduler's whole
    state, its length too (LinearLR's ``total_iters``, CosineAnnealingLR's ``T_max``), so a run resumed with
    a larger ``trainer.max_steps`` follows the old schedule, and past its end trains at its last lr (0 after a
    decay to 0). The configured scheduler is built on a one-parameter optimizer to compare."""
    stored = entries.get("lr_schedulers") or []
    if not stored or not isinstance(module, FactoryBuilt) or module.scheduler_factory is None:
        return
    import torch

    try:
        probe = module.optimizer_factory(params=[torch.nn.Parameter(torch.zeros(1))])
        fresh = _schedule_settings(module.scheduler_factory(optimizer=probe).state_dict())
    except Exception as exc:  # an optimizer that needs real parameters (a GPU one): nothing to compare
        log.debug("could not build method.scheduler to compare with the checkpoint's: %s", exc)
        return
    theirs = _schedule_settings(stored[0])
    differ = {
        k: (v, theirs[k]) for k, v in fresh.items() if k in theirs and _as_json(v) != _as_json(theirs[k])
    }
    if differ:
        log.warning(
            "ckpt_path=%r restores its lr scheduler's state, so these scheduler settings are not applied: %s "
            "(last learning rate: %s). The resumed run follows the checkpoint's schedule; to start a new "
            "schedule from its weights, export them (callbacks=[default,export]) and pass "
            "model.model_name_or_path=<that folder>.",
            ckpt_path,
            ", ".join(f"{k}={ours!r} (checkpoint: {old!r})" for k, (ours, old) in differ.items()),
            ", ".join(f"{lr:g}" for lr in stored[0].get("_last_lr") or []) or "unknown",
        )


def check_time_budget(ckpt_path: str | None, entries: Mapping[str, Any], trainer: L.Trainer) -> None:
    """Refuses a resume whose ``trainer.max_time`` the checkpoint has already used up: Lightning's Timer counts
    the training time across resumes, so the run stopped at once and exited 0, having trained nothing (a
    scheduler's requeue then looped, and an export published the old weights as the final ones)."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    budget = timer.time_remaining() if timer is not None else None  # the whole budget: nothing ran yet
    if budget is None:
        return
    used = ((entries.get("callbacks") or {}).get(timer.state_key) or {}).get("time_elapsed", {}).get("train")
    if used is not None and used >= budget:
        raise ValueError(
            f"ckpt_path={ckpt_path!r} has trained for {timedelta(seconds=round(used))} of trainer.max_time="
            f"{timedelta(seconds=round(budget))} (Lightning counts the time across resumes), so this run would "
            "stop before its first step: raise trainer.max_time to train on"
        )


def _as_json(value: Any) -> str | None:
    """A setting as comparable text (a tuple and a list of the same values alike, and 1 and 1.0: betas
    (0.9, 0.999) are one setting however written); None for an object (a reward function, a partial):
    those are compared by the checks above, or not at all."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        # Through JSON and back with whole numbers read as floats: beta=1 and beta=1.0 are one setting.
        return json.dumps(json.loads(json.dumps(value), parse_int=float), sort_keys=True)
    except (TypeError, ValueError):
        return None


def warn_changed_settings(
    ckpt_path: str | None, entries: Mapping[str, Any], hparams: Mapping[str, Any]
) -> None:
    """Warns, naming them, of the method settings (``beta``, ``loss_type``, ``num_generations``, ...) that differ
    from those ``ckpt_path`` trained with: the resumed run applies its own from here on, which may be meant
    (a lower rate for the rest of the run) or a config edited since, and its results differ either way."""
    stored = entries.get("hyper_parameters") or {}
    changed = [
        f"method.{key}={ours!r} (checkpoint: {stored[key]!r})"
        for key, ours in hparams.items()
        if key in stored and None not in (a := _as_json(ours), b := _as_json(stored[key])) and a != b
    ]
    if changed:
        log.warning(
            "ckpt_path=%r trained with other method settings; the resumed run goes on with this run's: %s",
            ckpt_path, ", ".join(changed),
        )  # fmt: skip
