"""Settings checked once, before anything is built, each error naming its setting (``training.build``).

Every value refused here fails later today, and not where it was set: Lightning divides by
``trainer.accumulate_grad_batches`` and ``trainer.val_check_interval`` (a ``ZeroDivisionError`` at
the first step or validation), the DataLoader names ``batch_size`` but not ``data.batch_size``,
transformers reads a missing local folder as a malformed hub id, and the online methods' sampling
settings fail inside ``generate`` or in the loss's log-probs after the first generation. Settings a
constructor checks (``num_generations``, ``beta``, ``epsilon``, ``loss_type``, reward names and
weights, ``max_length``) are left to it, so direct construction says the same.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig

from lightning_vlm.ckpt_path import check_ckpt_path
from lightning_vlm.counts import check_count
from lightning_vlm.data.sources import located_sources
from lightning_vlm.defaults import init_defaults
from lightning_vlm.methods.dynamic_sampling import DynamicSampling
from lightning_vlm.models.model_source import check_model_source

log = logging.getLogger(__name__)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_settings(cfg: DictConfig) -> None:
    """Refuse settings of a composed train/eval config that would fail later with a traceback."""
    trainer, data = cfg.get("trainer") or {}, cfg.get("data") or {}
    method, model = cfg.get("method") or {}, cfg.get("model") or {}
    online = _check_data_shape(method, data)  # GRPO, GSPO, RLOO, Online DPO
    _check_trainer(trainer, online)
    # val_batch_size null: batch_size's; batch_size null would make the loader yield single rows.
    for key, allow_none in (("batch_size", False), ("val_batch_size", True)):
        if key in data:
            check_count(f"data.{key}", data.get(key), allow_none, hint=" (rows per batch and process)")
    if model.get("model_name_or_path") is not None:
        # Local folders only: whether a hub id can be fetched is said by the scale guard (tiny settings)
        # or by the VLM itself, which also knows the cache folder and revision.
        check_model_source(str(model.model_name_or_path), hub=False)
    for key, path, where in located_sources(data):
        if where == "missing":
            # Found only once the model is built and fit has started, inside Lightning's data hooks.
            raise FileNotFoundError(
                f"data.{key}={path!r}: no such file or folder ({Path(path).expanduser().resolve()}); "
                "relative paths are read from the directory train.py runs in"
            )
    if (
        cfg.get("validate_before_fit")
        and _number(trainer.get("limit_val_batches"))
        and not trainer.limit_val_batches
    ):
        # Lightning's validate then runs nothing and returns no metrics: training.py found no first row.
        raise ValueError(
            "validate_before_fit=true validates before training, but trainer.limit_val_batches=0 turns "
            "validation off: drop one of them"
        )
    check_ckpt_path(cfg.get("ckpt_path"))
    _check_image_budget(data)
    optimizer = method.get("optimizer") or {}
    lr = optimizer.get("lr")
    if lr is not None and (not _number(lr) or lr < 0):  # torch's own errors come from its step, unnamed
        raise ValueError(f"method.optimizer.lr must be a number >= 0, got {lr!r}")
    if online:
        _check_online(method, data)
        _check_online_trainer(trainer, method, data)
        _check_vllm_correction(method, cfg.get("callbacks") or {})
        _warn_unread_correction(method, cfg.get("callbacks") or {})
        _check_vllm_temperature(method, cfg.get("callbacks") or {})
        _warn_vllm_min_p_order(method, cfg.get("callbacks") or {})


def _target_class(node: Any) -> type | None:
    """The class a config node's ``_target_`` names; None without one, or where it does not import (then
    instantiating it says why)."""
    target = node.get("_target_") if isinstance(node, Mapping) else None
    if not isinstance(target, str):
        return None
    try:
        found = get_class(target)
    except Exception:
        return None
    return found if isinstance(found, type) else None


def _check_image_budget(data: Any) -> None:
    """The pixel budget's settings, and the synthetic kinds it must not rescale, refused before the model
    loads (the DataModule checks them too, but the synthetic rows only in ``setup``, inside fit)."""
    from lightning_vlm.data.image_budget import ImageBudget
    from lightning_vlm.data.sources import check_synthetic_budget
    from lightning_vlm.data.synthetic import SYNTHETIC_OPTIONS

    budget = ImageBudget(data.get("image_max_pixels"), data.get("image_min_pixels"))
    specs = [data.get("train"), data.get("val")]
    if any(s == "synthetic" or (isinstance(s, Mapping) and s.get("path") == "synthetic") for s in specs):
        synthetic = {**SYNTHETIC_OPTIONS, **(data.get("synthetic") or {})}
        check_synthetic_budget(synthetic["kinds"], synthetic["image_size"], budget)


def _check_data_shape(method: Any, data: Any) -> bool:
    """Refuses data of another shape than the method trains on (``method=grpo data=sft``: a ``KeyError:
    'prompt'`` after the model loaded); returns whether the method is an online one. Decided by the classes,
    not by the keys: ``+method.num_generations=3`` (Hydra's own advice for a key DPO lacks) made DPO an
    online method here, and its refusal named a setting DPO does not have."""
    from lightning_vlm.methods.online import OnlineRL

    method_class, data_class = _target_class(method), _target_class(data)
    if method_class is None:  # a method node without a target: judged by its keys
        return "num_generations" in method
    wants, has = getattr(method_class, "data_shape", None), getattr(data_class, "shape", None)
    if wants and has and wants != has:
        raise ValueError(
            f"method {method_class.__name__} trains on {wants} rows, but data is {data_class.__name__} ({has} "
            f"rows): drop the data= override (the method's config selects data={wants}), or pass data={wants}"
        )
    return issubclass(method_class, OnlineRL)


def _check_trainer(trainer: Any, online: bool) -> None:
    # Lightning compares these with numbers in its constructor: a TypeError naming neither setting.
    steps = trainer.get("max_steps", -1)
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise ValueError(
            f"trainer.max_steps must be a whole number (-1: no step limit, trainer.max_epochs then bounds the "
            f"run), got {steps!r}"
        )
    epochs = trainer.get("max_epochs")
    if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool)):
        raise ValueError(
            f"trainer.max_epochs must be a whole number (-1: no epoch limit) or null, got {epochs!r}"
        )
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ValueError(
            f"trainer.accumulate_grad_batches must be an integer >= 1 (1: no accumulation), got {accumulate!r}"
        )
    if online and accumulate not in (None, 1):
        # Lightning's own message speaks of "manual optimization"; say what to set instead.
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate}: online methods step the optimizer themselves "
            "(every generation, steps_per_generation times), so it must be 1. To fit memory use "
            "method.micro_batch_size (completions per forward/backward inside one optimizer step)."
        )
    interval = trainer.get("val_check_interval")
    if _number(interval) and interval <= 0:
        raise ValueError(
            f"trainer.val_check_interval must be > 0 (steps, or a fraction of an epoch) or null, got {interval}; "
            "to skip validation set trainer.limit_val_batches=0"
        )
    if isinstance(interval, float) and trainer.get("check_val_every_n_epoch") is None:
        # Lightning's own error comes at fit start; runs here validate by step (trainer/default.yaml).
        raise ValueError(
            f"trainer.val_check_interval={interval} is a fraction of an epoch, which Lightning takes only with "
            "trainer.check_val_every_n_epoch set (e.g. 1); runs here validate every N steps: give an integer"
        )


def _check_online(method: Any, data: Any) -> None:
    check_count("method.max_completion_length", method.get("max_completion_length"), allow_none=False)
    check_count(
        "method.val_num_generations", method.get("val_num_generations"), allow_none=False,
        hint=" (sampled completions per held-out prompt)",
    )  # fmt: skip
    sampling = method.get("sampling") or {}
    temperature = sampling.get("temperature", 1.0)
    if not _number(temperature) or temperature <= 0:
        # TRL divides the logits by it too; greedy decoding has no log-probs to learn from.
        raise ValueError(
            f"method.sampling.temperature must be > 0 for online training (the loss's log-probs divide "
            f"the logits by it, and greedy rollouts of a prompt are identical), got {temperature!r}"
        )
    if sampling.get("do_sample", True) is not True:
        raise ValueError(
            "method.sampling.do_sample must be true for online training: greedy rollouts of a prompt are "
            f"identical, so every advantage is 0 and nothing is learned; got {sampling.get('do_sample')!r}"
        )
    top_p = sampling.get("top_p", 1.0)
    if not _number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"method.sampling.top_p must be in (0, 1] (1: off), got {top_p!r}")
    top_k = sampling.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"method.sampling.top_k must be >= 0 or null (0 or null: off), got {top_k!r}")
    min_p = sampling.get("min_p")
    if min_p is not None and (not _number(min_p) or not 0 <= min_p <= 1):
        raise ValueError(f"method.sampling.min_p must be in [0, 1] or null (0 or null: off), got {min_p!r}")
    penalty = sampling.get("repetition_penalty")
    if penalty is not None and (not _number(penalty) or penalty <= 0):
        raise ValueError(
            f"method.sampling.repetition_penalty must be > 0 or null (1 or null: off), got {penalty!r}"
        )
    layout = _generation_layout(method, data)
    if layout is not None:
        groups, generations, steps, dynamic = layout
        prompts = data.get("batch_size")
        if "num_candidates" in method and groups % steps:
            # Online DPO trains on pairs (one per prompt); a pair never spans two steps.
            raise ValueError(
                f"method.steps_per_generation={steps} does not divide Online DPO's {groups} pairs a generation "
                f"(one per prompt, data.batch_size={prompts}) into equal optimizer steps"
            )
        if (groups * generations) % steps:
            source = (
                f"⌈data.batch_size={prompts} / method.dynamic_sampling.max_num_gen_batches="
                f"{dynamic.max_num_gen_batches}⌉ = {groups} groups"
                if dynamic.enabled
                else f"data.batch_size={prompts}"
            )
            raise ValueError(
                f"method.steps_per_generation={steps} does not divide the {groups * generations} completions "
                f"a generation trains on ({source} × method.num_generations={generations}) into "
                "equal optimizer steps"
            )


def _check_online_trainer(trainer: Any, method: Any, data: Any) -> None:
    """Trainer settings an online method's own optimisation loop cannot honour (Lightning or DeepSpeed
    would refuse them only once training starts)."""
    if trainer.get("gradient_clip_val"):  # 0 is Lightning's "no clipping", which it accepts here too
        raise ValueError(
            f"trainer.gradient_clip_val={trainer.get('gradient_clip_val')}: online methods step the optimizer "
            "themselves, and Lightning clips only automatic optimisation; set method.max_grad_norm instead "
            "(TRL's max_grad_norm, 1.0 by default) and trainer.gradient_clip_val=null"
        )
    strategy = trainer.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else str(strategy or "")
    micro = method.get("micro_batch_size")
    if "deepspeed" not in target.lower() or micro is None:
        return
    layout = _generation_layout(method, data)
    if layout is None or not isinstance(micro, int) or micro < 1:
        return  # other checks name these; the method refuses several micro-batches at its first step
    groups, generations, steps, _ = layout
    per_step = groups * generations // steps
    if micro < per_step:
        raise ValueError(
            f"method.micro_batch_size={micro} splits each optimizer step's {per_step} completions into several "
            "backward passes, which DeepSpeed's engine does not accumulate in a manual-optimisation loop: set "
            "method.micro_batch_size=null with trainer=deepspeed_* (to bound activation memory, lower "
            "data.batch_size or raise method.steps_per_generation instead)"
        )


def _generation_layout(method: Any, data: Any) -> tuple[int, int, int, DynamicSampling] | None:
    """The groups a generation trains on, ``num_generations``, ``steps_per_generation`` and the dynamic
    sampling settings; None unless the three counts are integers >= 1 (other checks name them).
    With dynamic sampling a generation trains on one round of the pool, not on the whole batch."""
    prompts, generations = data.get("batch_size"), method.get("num_generations")
    steps = method.get("steps_per_generation", 1)
    dynamic = DynamicSampling.of(_rounds_only(method.get("dynamic_sampling")))
    if not all(isinstance(v, int) and v >= 1 for v in (prompts, generations, steps)):
        return None
    return dynamic.round_size(prompts), generations, steps, dynamic


# Sampling settings that reshape the distribution vLLM samples from, and their neutral values.
_RESHAPING = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0))


def _check_vllm_correction(method: Any, callbacks: Any) -> None:
    """The vLLM importance-sampling correction and the off-policy mask compare the trainer's log-probs
    (temperature and the suppressed vision tokens applied, nothing else) with vLLM's: both must
    describe one distribution."""
    vllm = callbacks.get("vllm_generation")
    compared = [
        name
        for name, on in (
            ("method.vllm_importance_sampling_correction=true", method.get("vllm_importance_sampling_correction")),
            (f"method.off_policy_mask_threshold={method.get('off_policy_mask_threshold')}",
             method.get("off_policy_mask_threshold") is not None),
        )
        if on
    ]  # fmt: skip
    if not vllm or not compared:
        return
    setting = " and ".join(compared)
    mode = (vllm.get("engine") or {}).get("logprobs_mode")
    if mode == "raw_logprobs":
        raise ValueError(
            f"callbacks.vllm_generation.engine.logprobs_mode=raw_logprobs with {setting}: raw log-probs come "
            "before temperature and the suppressed tokens, the trainer's after, so every token's ratio is off; "
            "use processed_logprobs"
        )
    sampling = method.get("sampling") or {}
    reshaped = [
        f"method.sampling.{key}={sampling[key]}"
        for key, neutral in _RESHAPING
        if sampling.get(key) is not None and sampling[key] != neutral
    ]
    if reshaped:
        raise ValueError(
            f"{', '.join(reshaped)} with generation by vLLM and {setting}: vLLM's log-probs are those of the "
            "truncated or penalised distribution it samples, the trainer's those of the whole one, so every "
            "token's ratio is below 1: a sequence-level correction masks long answers, and the off-policy "
            "mask drops every negative sample. Set top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, "
            "or turn the setting off"
        )


def _warn_unread_correction(method: Any, callbacks: Any) -> None:
    """The correction's mode and bounds shape the ratio of vLLM's log-probs to the trainer's: with HF
    ``generate`` (no ``callbacks.vllm_generation``) the sampler is the policy, and they are never read."""
    if callbacks.get("vllm_generation"):
        return
    from lightning_vlm.methods.online import OnlineRL

    defaults = init_defaults(OnlineRL)
    changed = [
        f"method.{key}={method[key]!r}"
        for key in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                    "vllm_importance_sampling_clip_min")
        if key in method and method[key] != defaults[key]
    ]  # fmt: skip
    if changed:
        log.warning("%s: these do nothing with generation by HF generate (the policy samples, so there is no "
                    "sampler mismatch to correct); they apply with generation=vllm_colocate or vllm_server",
                    ", ".join(changed))  # fmt: skip


def _check_vllm_temperature(method: Any, callbacks: Any) -> None:
    """vLLM samples at no temperature below 0.01 (it raises lower ones to 0.01), while the trainer's
    log-probs divide by the one set: the ratios and the loss would describe another distribution."""
    temperature = (method.get("sampling") or {}).get("temperature", 1.0)
    if "num_candidates" in method:
        return  # Online DPO: its loss's log-probs are at temperature 1, the temperature only samples
    if callbacks.get("vllm_generation") and _number(temperature) and 0 < temperature < 0.01:
        raise ValueError(
            f"method.sampling.temperature={temperature} with generation by vLLM, which samples at 0.01 for any "
            "temperature below it, while the trainer's log-probs divide by the one set; use a temperature >= 0.01"
        )


def _warn_vllm_min_p_order(method: Any, callbacks: Any) -> None:
    """vLLM applies min_p before top_p, HF ``generate`` after it. The two do not commute (top_p keeps a share
    of what is left), so together they keep other tokens, and the two samplers draw other completions."""
    sampling = method.get("sampling") or {}
    neutral = dict(_RESHAPING)
    top_p, min_p = sampling.get("top_p", neutral["top_p"]), sampling.get("min_p", neutral["min_p"])
    if not (callbacks.get("vllm_generation") and sampling.get("do_sample", True)):
        return
    if _number(top_p) and _number(min_p) and top_p < 1 and min_p > 0:
        log.warning("method.sampling.top_p=%s with min_p=%s: vLLM applies min_p first and HF generate applies it "
                    "after top_p, so they keep other tokens; keep one of the two for the same sampling on both",
                    top_p, min_p)  # fmt: skip


def _rounds_only(value: Any) -> Any:
    """``method.dynamic_sampling`` without its ``filter``, which may still be an uninstantiated
    ``_target_`` here: its other fields get checked (and named) before anything is built."""
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if k != "filter"}
    return value
