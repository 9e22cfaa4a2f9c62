"""vLLM rollout/trainer importance correction (TIS truncate, MIS mask) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vlm.losses.importance import rollout_correction, split_trl_mode

L2, L4, L15 = math.log(2), math.log(4), math.log(1.5)
# old - sampler per token: row 0 ratios 2, 0.5, 4; row 1 ratios 1.5, 1, padding
OLD = torch.zeros(2, 3)
SAMPLER = torch.tensor([[-L2, L2, -L4], [-L15, 0.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
TOKEN_RATIOS = [2.0, 0.5, 4.0, 1.5, 1.0]


def close(actual: torch.Tensor, expected: list[list[float]] | float) -> None:
    """Assert closeness to a hand-written value."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def test_token_truncate_caps_each_token():
    w, m = rollout_correction(OLD, SAMPLER, MASK, "token", "truncate", clip_max=3.0)
    close(w, [[2.0, 0.5, 3.0], [1.5, 1.0, 0.0]])
    close(m["is_ratio/capped_frac"], 1 / 5)
    close(m["is_ratio/mean"], sum(TOKEN_RATIOS) / 5)
    close(m["is_ratio/min"], 0.5)
    close(m["is_ratio/max"], 4.0)


def test_token_mask_zeroes_tokens_over_cap():
    w, m = rollout_correction(OLD, SAMPLER, MASK, "token", "mask", clip_max=3.0)
    close(w, [[2.0, 0.5, 0.0], [1.5, 1.0, 0.0]])
    close(m["is_ratio/capped_frac"], 1 / 5)


def test_sequence_level_uses_product_of_token_ratios():
    # row 0: 2 · 0.5 · 4 = 4 > cap; row 1: 1.5 · 1 = 1.5
    w, m = rollout_correction(OLD, SAMPLER, MASK, "sequence", "truncate", clip_max=3.0)
    close(w, [[3.0, 3.0, 3.0], [1.5, 1.5, 0.0]])
    close(m["is_ratio/capped_frac"], 1 / 2)
    close(m["is_ratio/mean"], (4.0 + 1.5) / 2)
    close(m["is_ratio/min"], 1.5)
    close(m["is_ratio/max"], 4.0)
    w, m = rollout_correction(OLD, SAMPLER, MASK, "sequence", "mask", clip_max=3.0)
    close(w, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0]])
    close(m["is_ratio/capped_frac"], 1 / 2)


def test_sampler_kl_is_k3_token_mean():
    _, m = rollout_correction(OLD, SAMPLER, MASK, "token", "truncate")
    # k3 with ρ = π_trainer/π_sampler under sampler samples: ρ - log ρ - 1
    close(m["sampler_kl"], sum(r - math.log(r) - 1 for r in TOKEN_RATIOS) / 5)
    close(m["sampler_logp_diff/max"], L4)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_completion_token_describes_no_ratio(level):
    # A rank whose rows were all skipped holds no completion: its ratio statistics were 0, which the
    # minimum over ranks then reported as the run's smallest ratio.
    for rows in (torch.zeros(0, 3), torch.zeros(2, 3)):
        w, m = rollout_correction(rows, rows, rows, level, "truncate")
        assert w.shape == rows.shape and not w.any()
        for name in ("is_ratio/mean", "is_ratio/min", "is_ratio/max"):
            assert m[name].isnan(), name
        close(m["is_ratio/capped_frac"], 0.0)
        close(m["sampler_kl"], 0.0)


def test_weights_are_detached_and_equal_logps_give_ones():
    old = torch.randn(2, 4, requires_grad=True)
    w, m = rollout_correction(old, old.detach().clone(), torch.ones(2, 4), "sequence", "mask")
    assert not w.requires_grad
    close(w, [[1.0] * 4] * 2)
    close(m["sampler_kl"], 0.0)


def test_long_sequence_overflow_does_not_make_nan():
    # Σ log-ratio = 100 overflows exp in float32; weights must still be finite
    old = torch.ones(1, 100)
    for mode, expected in (("truncate", 3.0), ("mask", 0.0)):
        w, _ = rollout_correction(old, torch.zeros(1, 100), torch.ones(1, 100), "sequence", mode)
        assert torch.isfinite(w).all() and w.eq(expected).all()


def test_split_trl_mode_and_errors():
    assert split_trl_mode("sequence_mask") == ("sequence", "mask")
    assert split_trl_mode("token_truncate") == ("token", "truncate")
    with pytest.raises(ValueError, match="token_truncate"):
        split_trl_mode("token_clip")
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(OLD, SAMPLER, MASK, "token", "clip")  # type: ignore[arg-type]


# TRL's vllm_importance_sampling_clip_min: ratios below C_min are raised to it (truncate) or zeroed (mask).
# Token ratios 2, 0.5, 4 | 1.5, 1; sequence ratios 4 | 1.5.
@pytest.mark.parametrize(
    ("level", "mode", "clip_min", "clip_max", "expected", "outside"),
    [
        ("token", "truncate", 0.8, 3.0, [[2.0, 0.8, 3.0], [1.5, 1.0, 0.0]], 2 / 5),
        ("token", "mask", 0.8, 3.0, [[2.0, 0.0, 0.0], [1.5, 1.0, 0.0]], 2 / 5),
        # no upper bound: TRL's clip_max=None, "strictly mask ratios below C_min"
        ("token", "mask", 1.2, None, [[2.0, 0.0, 4.0], [1.5, 0.0, 0.0]], 2 / 5),
        ("sequence", "truncate", 2.0, 3.0, [[3.0, 3.0, 3.0], [2.0, 2.0, 0.0]], 1.0),
        ("sequence", "mask", 2.0, 5.0, [[4.0, 4.0, 4.0], [0.0, 0.0, 0.0]], 1 / 2),
        # C_min 0 is no bound, as in TRL (a ratio is never below 0)
        ("sequence", "mask", 0.0, 5.0, [[4.0, 4.0, 4.0], [1.5, 1.5, 0.0]], 0.0),
    ],
)
def test_clip_min_and_clip_max_bound_the_ratio_as_trl_does(
    level, mode, clip_min, clip_max, expected, outside
):
    w, m = rollout_correction(OLD, SAMPLER, MASK, level, mode, clip_max=clip_max, clip_min=clip_min)
    close(w, expected)
    close(m["is_ratio/capped_frac"], outside)


@pytest.mark.parametrize(
    ("clip_min", "clip_max", "match"),
    [
        (None, 0.0, "clip_max must be > 0"),
        (-0.1, 3.0, "clip_min must be >= 0"),
        (4.0, 3.0, "must be below"),
        (3.0, 3.0, "must be below"),
    ],  # fmt: skip
)
def test_bounds_that_are_no_ratio_range_are_refused(clip_min, clip_max, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(OLD, SAMPLER, MASK, "token", "mask", clip_max=clip_max, clip_min=clip_min)


def test_a_truncation_without_either_bound_is_refused_as_trl_does():
    with pytest.raises(ValueError, match="needs vllm_importance_sampling_clip_min or"):
        rollout_correction(OLD, SAMPLER, MASK, "token", "truncate", clip_max=None, clip_min=None)
    w, _ = rollout_correction(OLD, SAMPLER, MASK, "token", "mask", clip_max=None, clip_min=None)
    close(w, [[2.0, 0.5, 4.0], [1.5, 1.0, 0.0]])  # masking with no bound masks nothing


def test_an_open_upper_bound_keeps_weights_finite_and_padding_zero():
    # Σ log-ratio = 100 over 3 tokens of 4: exp overflows float32; inf · 0 made the padding NaN.
    old, mask = torch.ones(1, 4) * 100 / 3, torch.tensor([[1, 1, 1, 0]])
    w, _ = rollout_correction(old, torch.zeros(1, 4), mask, "sequence", "mask", clip_max=None, clip_min=0.5)
    close(w, [[math.exp(20.0)] * 3 + [0.0]])
