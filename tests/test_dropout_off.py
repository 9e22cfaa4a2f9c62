"""TRL's ``disable_dropout``: DPO, KTO and Online DPO turn the policy's dropout off by default (the
reference runs without it, so the policy's log-probs, and the implicit rewards or z0 with them, were
noisy); GRPO and RLOO keep it, as TRL does."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.methods.common import DROPOUT_MODULES
from lightning_vlm.methods.dpo import DPO
from lightning_vlm.methods.grpo import GRPO
from lightning_vlm.methods.kto import KTO
from lightning_vlm.methods.online_dpo import OnlineDPO
from lightning_vlm.models.vlm import VLM

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.5, "init_lora_weights": False}
SGD = partial(torch.optim.SGD, lr=0.0)


def _dropouts(module: torch.nn.Module) -> list[float]:
    return [m.p for m in module.vlm.modules() if isinstance(m, DROPOUT_MODULES)]


@pytest.mark.parametrize(("method", "data"), [(DPO, "preference"), (KTO, "unpaired")])
def test_preference_losses_are_deterministic_in_train_mode(tiny_path, method, data):
    rows = synthetic_rows(data, 4, seed=0)
    losses = {}
    for off in (True, False):
        torch.manual_seed(0)
        module = method(VLM(tiny_path(), lora=LORA), optimizer=SGD, disable_dropout=off).train()
        assert _dropouts(module) and all((p == 0) == off for p in _dropouts(module))
        losses[off] = [module._loss(rows, train=True)[0].item() for _ in range(2)]
    assert losses[True][0] == losses[True][1]  # dropout off: the same rows give the same loss
    assert losses[False][0] != losses[False][1]  # on (TRL's disable_dropout=false): two draws


def test_online_dpo_turns_dropout_off_and_grpo_keeps_it(tiny_path):
    assert set(_dropouts(OnlineDPO(VLM(tiny_path(), lora=LORA), optimizer=SGD))) == {0.0}
    assert set(_dropouts(GRPO(VLM(tiny_path(), lora=LORA), optimizer=SGD))) == {0.5}
    assert set(_dropouts(GRPO(VLM(tiny_path(), lora=LORA), optimizer=SGD, disable_dropout=True))) == {0.0}
