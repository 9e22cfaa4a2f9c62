"""KTO's two halves: the matched answers with autograd, the mismatched ones (z0's KL estimate) without, as
TRL runs them, and still one vision pass per row; loss and gradients are those of one forward over both."""

from __future__ import annotations

import pytest
import torch

from helpers import TowerCounter
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.losses.kto import kto_losses, kto_reference_point
from lightning_vlm.methods.kto import KTO
from lightning_vlm.methods.preference_batch import encode_columns, encode_pairs, split_pairs
from lightning_vlm.models import vision_every_rank
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import VLM


def kto(tiny_path, family: str, one_vision_pass: bool = True) -> KTO:
    torch.manual_seed(0)
    vlm = VLM(tiny_path(family), freeze_vision_tower=False)  # gradients reach the tower through its features
    module = KTO(
        vlm, optimizer=lambda params: torch.optim.SGD(params, lr=0.0), one_vision_pass=one_vision_pass
    )
    with torch.no_grad():  # off its frozen reference, so the rewards and the KL estimate are not 0
        rng = torch.Generator().manual_seed(0)
        for p in vlm.parameters():
            p.add_(torch.randn(p.shape, generator=rng) * 0.02)
    return module


def unpaired_rows() -> list[dict]:
    rows = synthetic_rows("unpaired", 4, seed=3)
    # another grid (Qwen), other tiles (LLaVA-Next)
    rows[1]["images"] = [rows[1]["images"][0].resize((84, 140))]
    return rows


def mismatched_pairs(rows: list[dict]) -> list[dict]:
    others = [rows[i - 1]["completion"] for i in range(len(rows))]  # 4 rows of 4 prompts: the rotation
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": o, "images": r["images"]}
            for r, o in zip(rows, others, strict=True)]  # fmt: skip


def one_forward(module: KTO, rows: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss from one forward over every row's matched and mismatched answers (the naive batch), and the
    summed log-probs [B] it came from: policy, reference, and both on the mismatched answers."""
    batch = encode_pairs(module.vlm, mismatched_pairs(rows), one_vision_pass=False)
    logps, kl_logps = split_pairs(module.vlm.token_logps(batch.inputs, batch.completion_mask)[0].sum(dim=1))
    ref, kl_ref = split_pairs(module.ref.token_logps(batch.inputs, batch.completion_mask)[0].sum(dim=1))
    z0 = kto_reference_point((kl_logps - kl_ref).detach())
    desirable = torch.tensor([bool(r["label"]) for r in rows])
    return kto_losses(logps - ref, desirable, z0, 0.1).mean(), [logps, ref, kl_logps, kl_ref]


def gradients(module: KTO, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.vlm.model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.vlm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_the_kl_half_runs_without_autograd_and_the_step_is_unchanged(tiny_path, family):
    module, rows = kto(tiny_path, family), unpaired_rows()
    forwards: list[tuple[int, bool]] = []
    hook = module.vlm.backbone.register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append((kwargs["input_ids"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True,
    )
    try:
        with TowerCounter(module.vlm.vision_tower) as tower:
            loss, _, _ = module._loss(rows, train=True)
    finally:
        hook.remove()
    # The policy's forwards (the reference is a copy): autograd keeps the activations of the 4 matched answers
    # only. It kept all 8 sequences': twice the memory, and backward work for answers whose gradient is 0.
    assert forwards == [(4, True), (4, False)], forwards
    # One policy vision pass over the 4 rows' images, shared by both halves
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "images": r["images"]} for r in rows]
    single = encode_columns(module.vlm, pairs, None, ("chosen",))[0]
    with torch.no_grad(), TowerCounter(module.vlm.vision_tower) as once:
        module.vlm.token_logps(single.inputs, single.completion_mask)
    assert (tower.calls, tower.units) == (1, once.units)
    expected, naive = one_forward(module, rows)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    # The KL half itself: z0 clamps a negative mean to 0, which would hide a wrong one in the loss.
    with torch.no_grad():
        halves = module._answer_logps(
            *encode_columns(module.vlm, mismatched_pairs(rows), None, ("chosen", "rejected"))
        )
    for got, want in zip([v for half in halves for v in half], naive, strict=True):
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    ours, naive = gradients(module, loss), gradients(module, expected)
    assert ours.keys() == naive.keys()
    assert any(".visual." in n or "vision" in n for n in ours), "the tower's gradient is compared too"
    for name, grad in naive.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def text_only(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["images"] = []
        row["prompt"][0]["content"] = [b for b in row["prompt"][0]["content"] if b["type"] == "text"]
    return rows


@pytest.mark.parametrize("one_vision_pass", [True, False])
def test_a_text_only_rank_runs_the_tower_as_often_as_a_rank_with_images(
    tiny_path, one_vision_pass, monkeypatch
):
    # FSDP gathers the tower's weights whenever it runs: every rank must run it in the same forwards
    # (vision_every_rank). Shared features: once for the policy (the KL half reuses them); TRL's two
    # forwards (one_vision_pass=false): once in each.
    module = kto(tiny_path, "qwen2_5_vl", one_vision_pass)
    monkeypatch.setattr(vision_every_rank, "needs_vision_pass", lambda *args: True)
    calls = []
    for rows in (unpaired_rows(), text_only(unpaired_rows())):
        with TowerCounter(module.vlm.vision_tower) as tower:
            loss, _, _ = module._loss(rows, train=True)
        loss.backward()
        calls.append(tower.calls)
    assert calls == ([1, 1] if one_vision_pass else [2, 2]), calls
