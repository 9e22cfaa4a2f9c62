"""Per-token log-probabilities and entropies from hidden states, without a [B, L, V] logits tensor.

Only the positions that are scored go through the LM head, in chunks; each chunk's log-probs are
``logit[target] - logsumexp(logits)``, so no full-vocabulary log-softmax is kept for every position.
Under autograd each chunk is checkpointed: its logits are recomputed in backward instead of stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..parallel.collectives import all_reduce_max


def scored_positions(target_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch and sequence indices of the scored tokens; token t is predicted from hidden state t-1."""
    mask = target_mask.bool().clone()
    mask[:, 0] = False  # nothing predicts the first token
    batch_idx, token_idx = mask.nonzero(as_tuple=True)
    return batch_idx, token_idx


def _chunk_logps(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    suppressed: torch.Tensor | None,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # float32 for the reduction: bf16 logsumexp over a large vocabulary loses the small log-probs.
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if suppressed is not None:
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    argmax = logits.detach().argmax(dim=-1)
    if not return_entropy:
        return logps, logps.new_zeros(()), argmax
    probs = torch.softmax(logits, dim=-1)
    # H = lse - E_p[logit]; masked logits are -inf with p = 0, so nan_to_num keeps 0 * -inf out.
    entropy = lse - (probs * logits.nan_to_num(neginf=0.0)).sum(dim=-1)
    return logps, entropy, argmax


def softcapped(head: Callable[[torch.Tensor], torch.Tensor], cap: float | None) -> Callable:
    """``head`` followed by Gemma's final logit soft-capping, ``cap · tanh(logits / cap)``; ``head`` as
    it is for ``cap=None``."""
    if cap is None:
        return head

    def capped(hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(hidden) / cap) * cap

    return capped


def selective_logps(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    return_entropy: bool = False,
    suppressed_ids: Sequence[int] | None = None,
    chunk_size: int = 1024,
    agree_chunks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probs, entropies (or None) and argmax ids of ``targets[N]`` given ``hidden[N, H]``, chunked.

    ``agree_chunks``: every rank calls ``head`` as often as the rank with the most tokens (empty chunks
    on the others; a collective), for a head whose every call gathers its weights (DeepSpeed ZeRO-3's
    hooks, a head that is its own FSDP unit): a rank with fewer chunks, or none, would otherwise pair its
    next collective with another's gather, and the job hung."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    suppressed = None
    if suppressed_ids:
        suppressed = torch.as_tensor(list(suppressed_ids), dtype=torch.long, device=hidden.device)
    # At least one call, empty or not: with nothing to score (every completion of a micro-batch masked as
    # truncated) the head still joins the graph and gets a (zero) gradient. Without one, DDP
    # (find_unused_parameters=False) never reduced the head's bucket, and the other ranks waited for it.
    chunks = max(1, math.ceil(hidden.shape[0] / chunk_size))
    if agree_chunks:
        chunks = int(all_reduce_max(torch.tensor([chunks], device=hidden.device)))
    logps, entropies, argmaxes = [], [], []
    for start in range(0, chunks * chunk_size, chunk_size):
        args = (hidden[start : start + chunk_size], targets[start : start + chunk_size])
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent, top = checkpoint(
                _chunk_logps, *args, head, temperature, suppressed, return_entropy, use_reentrant=False
            )
        else:
            lp, ent, top = _chunk_logps(*args, head, temperature, suppressed, return_entropy)
        logps.append(lp)
        entropies.append(ent)
        argmaxes.append(top)
    return torch.cat(logps), (torch.cat(entropies) if return_entropy else None), torch.cat(argmaxes)


def scatter_to_tokens(
    values: torch.Tensor, batch_idx: torch.Tensor, token_idx: torch.Tensor, shape
) -> torch.Tensor:
    """Place per-scored-token ``values`` back into a zero [B, L] tensor (differentiable)."""
    out = values.new_zeros(shape)
    return out.index_put((batch_idx, token_idx), values)


def naive_token_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation from full [B, L, V] logits: (logps, entropy), zero where not scored."""
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logps = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = target_mask[:, 1:].bool()
    pad = logps.new_zeros(logps.shape[0], 1)
    return (
        torch.cat([pad, logps * mask], dim=1),
        torch.cat([pad, entropy * mask], dim=1),
    )
