"""Safe arithmetic the losses share: divisors that never make 0/0, ratios that never overflow."""

from __future__ import annotations

import torch

# A log importance ratio above this is capped before exp: e^20 is far past any clip range, and float32's
# exp overflows at ~88.7, where inf * 0 (a zero advantage: a tied group, a masked token) is NaN in the
# loss and in exp's backward. Past the cap the gradient is 0 (VESPO's authors cap theirs too).
MAX_LOG_RATIO = 20.0


def capped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(min(log_ratio, MAX_LOG_RATIO)): an importance ratio that stays finite, gradient included."""
    return torch.exp(torch.clamp(log_ratio, max=MAX_LOG_RATIO))


def divisor(n: torch.Tensor | float | int, like: torch.Tensor) -> torch.Tensor:
    """``n`` as a divisor with ``like``'s dtype and device, 1 where it is 0: an all-masked step gives 0,
    not NaN. Counts below 1 are kept (a count over all ranks per rank: one token on two ranks is 0.5)."""
    n = torch.as_tensor(n, dtype=like.dtype, device=like.device)
    return torch.where(n > 0, n, torch.ones_like(n))
