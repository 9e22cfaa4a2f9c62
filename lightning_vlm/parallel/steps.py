"""What a manual-optimisation loop (the online methods) must do differently under each strategy.

DDP: skip the gradient all-reduce on all but an optimizer step's last micro-batch. FSDP: every
backpropagated loss must come out of a forward of the root FSDP module. DeepSpeed: its engine
accumulates and clips by itself, from its own settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ParallelStrategy
from torch.nn.parallel import DistributedDataParallel


def no_backward_sync(module: L.LightningModule) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (gradients accumulate locally, all-reduced on the step's last backward).

    A no-op elsewhere: FSDP's ``no_sync`` cannot be entered inside a root forward (and would keep
    unsharded gradients), so there every micro-batch reduce-scatters into the shards, which
    accumulate exactly.
    """
    strategy = module.trainer.strategy
    if isinstance(strategy, ParallelStrategy) and isinstance(strategy.model, DistributedDataParallel):
        return strategy.block_backward_sync()
    return contextlib.nullcontext()


class RootCalls:
    """The method :func:`root_forward` routes through the root FSDP module's forward (a mixin of the
    modules that use it)."""

    _root_call: tuple[Callable[..., Any], tuple] | None = None

    def _run_root_call(self) -> Any:
        fn, args = self._root_call
        return fn(*args)


def root_forward(module: L.LightningModule, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run as a forward of the root FSDP module when the model is sharded by FSDP.

    FSDP expects every backpropagated output to come out of a root forward: a loss computed inside
    ``training_step`` (one root forward) and backpropagated there, once per micro-batch, would
    leave the root's shards in their forward state. Lightning's own forward redirection calls the
    module's ``_run_root_call``; the arguments travel on the module, not through the root, which
    under mixed precision would cast the float ones (advantages, old log-probs) to bf16.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    strategy = module.trainer.strategy
    if not isinstance(strategy.model, FullyShardedDataParallel):
        return fn(*args)
    module._root_call = (fn, args)
    try:
        return strategy._forward_redirection(strategy.model, module, "_run_root_call")
    finally:
        module._root_call = None


def check_micro_batches(module: L.LightningModule, steps: list[list[torch.Tensor]]) -> None:
    """Refuse several backward passes per optimizer step under DeepSpeed (its engine would not
    accumulate them: its gradient accumulation is driven by its own step counter)."""
    if isinstance(module.trainer.strategy, DeepSpeedStrategy) and any(len(s) > 1 for s in steps):
        raise ValueError(
            f"micro_batch_size={module.hparams.micro_batch_size} splits an optimizer step into several "
            "backward passes, which DeepSpeed's engine does not accumulate in a manual-optimisation loop: "
            "set method.micro_batch_size=null with trainer=deepspeed_*"
        )


def engine_clipping(module: L.LightningModule, max_grad_norm: float | None) -> None:
    """Under DeepSpeed, ``max_grad_norm`` as its engine's ``gradient_clipping`` (0: none).

    DeepSpeed clips inside its own step (Lightning's ``clip_gradients`` is a no-op there), and Lightning
    refuses ``trainer.gradient_clip_val`` for a module that steps its own optimizer, so an online
    method's clip reaches the engine only through its config. Call it before the engine is built
    (``setup``). A DeepSpeed config's own ``gradient_clipping`` ("auto": filled, as in HF's Trainer)
    must agree with it: set silently over, a config's clip was dropped without a word.
    """
    strategy = module.trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        clip, given = float(max_grad_norm or 0.0), strategy.config.get("gradient_clipping", "auto")
        if given != "auto" and float(given) != clip:
            raise ValueError(
                f"the DeepSpeed config's gradient_clipping={given} differs from method.max_grad_norm="
                f'{max_grad_norm}, which the engine clips by: drop it from the config (or write "auto"), or '
                "set method.max_grad_norm to it"
            )
        strategy.config["gradient_clipping"] = clip


def partitions_weights(strategy: Any) -> bool:
    """Whether the strategy is DeepSpeed ZeRO-3: each rank holds a partition of every weight, and a
    module's ``state_dict()`` gives rank 0 empty placeholders (FSDP's units are gathered instead)."""
    config = strategy.config if isinstance(strategy, DeepSpeedStrategy) else None
    return bool(config) and config.get("zero_optimization", {}).get("stage") == 3
