"""Hand computations for the online feature tests: rollouts of chosen shapes, the weight update one real
training step makes, and the update a loss written out by hand makes (autograd through the same forward).

A feature is checked by comparing the two: SGD with lr 1 and no clipping moves every weight by minus its
gradient, so a step's update equals minus the gradient of the loss the feature's formula gives.
"""

from __future__ import annotations

import inspect

import torch
from online_helpers import FixedGenerator, fit_steps, sgd

from lightning_vlm.generation.base import Rollouts
from lightning_vlm.methods.rollout_buffer import RolloutBatch
from lightning_vlm.models.vlm import VLM


def shaped_rollouts(vlm: VLM, rows: list[dict], num_generations: int, lengths, finished, seed: int = 0):
    """Rollouts with completion ``i`` of ``lengths[i]`` tokens, ending with the end-of-turn token when
    ``finished[i]`` and truncated otherwise; the other tokens are random ordinary vocabulary tokens."""
    special = {
        vlm.end_of_turn_id,
        vlm.pad_token_id,
        *vlm.suppressed_token_ids,
        *vlm.tokenizer.all_special_ids,
    }
    allowed = torch.tensor([t for t in range(len(vlm.tokenizer)) if t not in special])
    rng = torch.Generator().manual_seed(seed)
    ids = []
    for length, done in zip(lengths, finished, strict=True):
        body = allowed[torch.randint(len(allowed), (length - int(done),), generator=rng)].tolist()
        ids.append(body + [vlm.end_of_turn_id] * int(done))
    assert len(ids) == len(rows) * num_generations
    texts = vlm.tokenizer.batch_decode(ids, skip_special_tokens=True)
    truncated = [not done for done in finished]
    return Rollouts(list(rows), ids, texts, truncated, num_generations)


def table_reward(rollouts: Rollouts, rewards: list[float]):
    """A reward function returning ``rewards[i]`` for completion ``i`` of ``rollouts`` (found by its ids)."""
    table = {tuple(c): r for c, r in zip(rollouts.completion_ids, rewards, strict=True)}
    assert len(table) == len(rewards), "completions must differ"

    def table_reward(completions, completion_ids, **kwargs):
        return [table[tuple(c)] for c in completion_ids]

    return table_reward


def step_update(path: str, cls, rows: list[dict], rollouts: Rollouts, modules: list | None = None, **kwargs):
    """(weight update, logged metrics) of one optimizer step of ``cls`` on fixed ``rollouts`` (SGD lr 1);
    the trained module is appended to ``modules`` when given."""
    vlm = VLM(path)
    before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
    longest = max(len(c) for c in rollouts.completion_ids)
    if (
        "num_candidates" in inspect.signature(cls).parameters
    ):  # Online DPO: the fixed pairs are its candidates
        kwargs.setdefault("num_candidates", rollouts.num_generations)
    module = cls(vlm, optimizer=sgd(), max_grad_norm=None, num_generations=rollouts.num_generations,
                 max_completion_length=longest, **kwargs)  # fmt: skip
    module.generator = FixedGenerator(rollouts)
    trainer = fit_steps(module, rows)
    if modules is not None:
        modules.append(module)
    update = {n: p.detach() - before[n] for n, p in vlm.named_parameters()}
    return update, {k: v.item() for k, v in trainer.callback_metrics.items()}


def completion_logps(vlm: VLM, rollouts: Rollouts):
    """Per-token log-probs [N, T] (with gradient), entropies and the 0/1 token mask of every completion,
    from the distribution the generators sample (temperature 1, suppressed tokens renormalised away)."""
    zeros = torch.zeros(len(rollouts), 1)
    batch = RolloutBatch.build(vlm, rollouts, zeros, zeros[:, 0])
    inputs = batch.inputs(torch.arange(len(batch)), vlm.config)
    logps, entropy = vlm.token_logps(
        inputs, inputs["completion_mask"].bool(), 1.0, return_entropy=True, mask_suppressed=True
    )
    w = batch.prompt_width
    return logps[:, w:], entropy[:, w:].detach(), batch.token_mask.float()


def hand_update(path: str, rollouts: Rollouts, loss_fn):
    """(weight update, loss value) of SGD lr 1 on ``loss_fn(logps, entropy, mask)`` at the initial weights."""
    vlm = VLM(path)
    logps, entropy, mask = completion_logps(vlm, rollouts)
    loss = loss_fn(logps, entropy, mask)
    loss.backward()
    update = {n: -p.grad if p.grad is not None else torch.zeros_like(p) for n, p in vlm.named_parameters()}
    return update, loss.item()


def assert_same_update(actual: dict, expected: dict) -> None:
    """Both updates moved the weights, and by the same amounts."""
    assert max(d.abs().max().item() for d in expected.values()) > 1e-4, "the hand loss must move weights"
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=2e-6, rtol=1e-4, msg=name)


def differs(a: dict, b: dict) -> bool:
    """Whether two updates differ clearly (so a test comparing with one of them can tell them apart)."""
    return max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4


def group_advantages_by_hand(
    rewards: list[float], num_generations: int, scale: str = "group"
) -> torch.Tensor:
    """(r - group mean) / (std + 1e-4) with the unbiased std of the group, of the batch, or 1 ("none")."""
    r = torch.tensor(rewards, dtype=torch.float64)
    groups = r.view(-1, num_generations)
    centred = groups - groups.mean(-1, keepdim=True)
    if scale == "group":
        centred = centred / (groups.std(-1, keepdim=True) + 1e-4)
    elif scale == "batch":
        centred = centred / (r.std() + 1e-4)
    return centred.reshape(-1).float()
