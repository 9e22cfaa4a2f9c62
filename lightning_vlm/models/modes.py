"""Eval mode for a forward pass, then every submodule's own mode back.

``model.train(was_training)`` afterwards would set *every* submodule to that mode, waking a frozen vision
tower that the VLM keeps in eval mode (``VLM(freeze_vision_tower=True)``): its dropout or drop-path would
then perturb the policy's forward but not the reference's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` in eval mode inside the block; each submodule's training flag restored after it."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
