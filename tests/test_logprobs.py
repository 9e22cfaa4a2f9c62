"""The chunked per-token log-prob maths against a written-out log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_vlm.models.logprobs import (
    naive_token_logps,
    scatter_to_tokens,
    scored_positions,
    selective_logps,
)


def _setup(n: int = 7, hidden: int = 5, vocab: int = 11):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(n, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    return head, h, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_selective_logps_equals_log_softmax(temperature, chunk_size):
    head, h, targets = _setup()
    logps, entropy, argmax = selective_logps(h, targets, head, temperature, True, chunk_size=chunk_size)
    ref = torch.log_softmax(head(h) / temperature, dim=-1)
    torch.testing.assert_close(logps, ref.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1), atol=1e-6, rtol=0)
    assert torch.equal(argmax, head(h).argmax(-1))


def test_selective_logps_gradients_match_under_chunk_checkpointing():
    head, h, targets = _setup()
    weights = torch.randn(len(targets))
    logps, entropy, _ = selective_logps(h, targets, head, 0.9, True, chunk_size=2)
    (weights * logps + entropy).sum().backward()
    got_h, got_w = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.weight.grad = None
    ref = torch.log_softmax(head(h) / 0.9, dim=-1)
    ref_loss = (weights * ref.gather(-1, targets[:, None]).squeeze(-1) - (ref.exp() * ref).sum(-1)).sum()
    ref_loss.backward()
    torch.testing.assert_close(got_h, h.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_w, head.weight.grad, atol=1e-6, rtol=0)


def test_suppressed_ids_renormalise_over_the_rest():
    head, h, targets = _setup()
    targets = targets.clamp(min=2)  # never score a suppressed id
    logps, entropy, _ = selective_logps(h, targets, head, 1.0, True, suppressed_ids=[0, 1])
    logits = head(h)
    logits[:, :2] = float("-inf")
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logps, ref.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, -(ref.exp() * ref.nan_to_num(neginf=0.0)).sum(-1), atol=1e-6, rtol=0)


def test_scored_positions_shift_and_scatter():
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.bool)
    b, t = scored_positions(mask)
    assert b.tolist() == [0, 0, 1] and t.tolist() == [2, 3, 1]  # position 0 cannot be predicted
    out = scatter_to_tokens(torch.tensor([1.0, 2.0, 3.0]), b, t, mask.shape)
    assert out.tolist() == [[0, 0, 1, 2], [0, 3, 0, 0]]


def test_naive_reference_scores_token_t_from_position_t_minus_1():
    logits = torch.randn(1, 3, 4)
    ids = torch.tensor([[0, 2, 1]])
    logps, _ = naive_token_logps(logits, ids, torch.ones(1, 3, dtype=torch.bool))
    expected = torch.log_softmax(logits[0, 1], -1)[1]
    torch.testing.assert_close(logps[0, 2], expected)
    assert logps[0, 0] == 0


def test_nothing_to_score_still_gives_the_head_a_gradient():
    # Every completion of a micro-batch masked (truncated): the head was never called, so it had no
    # gradient, and DDP (find_unused_parameters=False) waited for one forever (test_ddp_equivalence).
    head, body = torch.nn.Linear(4, 6), torch.nn.Linear(4, 4)
    hidden = body(torch.randn(0, 4))
    logps, entropy, argmax = selective_logps(hidden, torch.zeros(0, dtype=torch.long), head, 1.0, True)
    assert logps.shape == entropy.shape == argmax.shape == (0,)
    (logps.sum() + entropy.sum()).backward()
    for p in (*head.parameters(), *body.parameters()):
        assert p.grad is not None and not p.grad.any()
