"""Far off-policy tokens and empty steps keep every loss and gradient finite.

A token log-ratio above ~88.7 overflows float32's exp: the ratio was inf, and inf * 0 (a zero advantage
in a tied group, a masked token, exp's own backward) NaN, sometimes behind a normal-looking loss.
"""

from __future__ import annotations

import pytest
import torch

from lightning_vlm.losses.kl import k3_kl
from lightning_vlm.losses.normalizers import MAX_LOG_RATIO
from lightning_vlm.losses.policy import policy_loss
from lightning_vlm.losses.preference import sft_nll_loss
from lightning_vlm.losses.sft import sft_loss

MASK = torch.tensor([[1.0, 1.0, 0.0]])
OLD = torch.tensor([[-95.0, -1.0, 0.0]])  # the old policy gave the sampled token e^-95


def _loss_and_grad(advantage: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    logps = torch.tensor([[-0.5, -1.0, 0.0]], requires_grad=True)
    loss, _ = policy_loss(logps, OLD, torch.tensor([advantage]), MASK, **kwargs)
    loss.backward()
    return loss.detach(), logps.grad


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo", "sapo", "cispo", "luspo"])
@pytest.mark.parametrize("advantage", [0.0, 1.0, -1.0])
def test_an_overflowing_ratio_gives_finite_losses_and_gradients(loss_type, advantage):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    loss, grad = _loss_and_grad(advantage, loss_type=loss_type, **extra)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    if advantage == 0.0:
        assert loss == 0 and (grad == 0).all()


def test_hand_computed_values_past_and_within_the_cap():
    # dapo, A = +1: token 0's ratio (e^94.5) is clipped at 1.2 (no gradient), token 1's is 1: loss -(1.2 + 1)/2
    loss, grad = _loss_and_grad(1.0, loss_type="dapo")
    assert loss.item() == pytest.approx(-1.1) and grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0])
    # A = -1: the unclipped term is capped at e^20 (it was inf): (e^20 + 1)/2, and no gradient past the cap
    loss, grad = _loss_and_grad(-1.0, loss_type="dapo")
    assert loss.item() == pytest.approx((torch.exp(torch.tensor(MAX_LOG_RATIO)).item() + 1) / 2)
    assert grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0])


def test_bias_corrected_and_plain_k3_kl_stay_finite():
    logps = torch.tensor([[-0.5, -1.0, 0.0]], requires_grad=True)
    loss, metrics = policy_loss(logps, OLD, torch.tensor([1.0]), MASK, ref_logps=logps.detach().clone(), beta=0.04,
                                use_bias_correction_kl=True, loss_type="dapo")  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and metrics["kl"] == 0 and torch.isfinite(logps.grad).all()
    # policy e^-93 below the reference: k3 = e^d - d - 1 with d capped at 20 (it was inf)
    logp = torch.tensor([-95.0], requires_grad=True)
    kl = k3_kl(logp, torch.tensor([-2.0]))
    kl.sum().backward()
    assert kl.item() == pytest.approx(torch.exp(torch.tensor(20.0)).item() - 21.0) and logp.grad.item() == 0
    # within the cap the value is Schulman's: d = 1
    assert k3_kl(torch.tensor([-3.0]), torch.tensor([-2.0])).item() == pytest.approx(torch.e - 2.0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo", "cispo", "vespo"])
def test_a_zero_normaliser_gives_zero_not_nan(loss_type):
    # an all-masked step whose count over ranks is 0
    logps = torch.zeros(2, 3, requires_grad=True)
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    loss, _ = policy_loss(logps, logps.detach(), torch.ones(2), torch.zeros(2, 3), loss_type=loss_type,
                          num_items_in_batch=0, num_sequences_in_batch=0, entropy=torch.zeros(2, 3),
                          entropy_coef=0.1, **extra)  # fmt: skip
    assert loss.item() == 0
    assert sft_nll_loss(torch.tensor([-2.0, -1.0]), torch.tensor([0, 0]), "token_mean", num_tokens=0).tolist() == [
        4.0, 2.0]  # fmt: skip
    assert sft_loss(torch.zeros(1, 2), torch.zeros(1, 2), num_items_in_batch=0).item() == 0
