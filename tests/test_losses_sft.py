"""The SFT loss and token accuracy against hand-computed values."""

from __future__ import annotations

import math

import torch

from lightning_vlm.losses.sft import sft_loss, token_accuracy


def test_sft_loss_is_mean_nll_over_masked_tokens():
    logps = torch.tensor([[math.log(0.5), math.log(0.25), -9.0], [math.log(0.125), -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (-ln .5 - ln .25 - ln .125) / 3 = (1 + 2 + 3) ln2 / 3 = 2 ln 2
    assert torch.isclose(sft_loss(logps, mask), torch.tensor(2 * math.log(2)))


def test_sft_loss_empty_mask_is_zero_not_nan():
    assert sft_loss(torch.zeros(2, 3), torch.zeros(2, 3)).item() == 0.0


def test_token_accuracy_counts_only_masked():
    pred = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tgt = torch.tensor([[1, 0, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    correct, total = token_accuracy(pred, tgt, mask)
    assert (correct.item(), total.item()) == (3, 5)


def test_a_normaliser_under_one_token_per_rank_is_kept():
    # 1 target token on 2 ranks: each divides its sum by 1 / 2, so DDP's mean of the two losses is that
    # token's NLL (a clamp at 1 halved it).
    logps, mask = torch.tensor([[math.log(0.25)]]), torch.tensor([[1]])
    ranks = [sft_loss(logps, mask, 0.5), sft_loss(torch.zeros(1, 1), torch.zeros(1, 1), 0.5)]
    assert torch.isclose(sum(ranks) / 2, torch.tensor(2 * math.log(2)))
