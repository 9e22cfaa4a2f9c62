"""Online DPO's settings through a real training step, against the loss written out by hand: the
``sigmoid`` and ``ipo`` losses, ``missing_eos_penalty`` and ties (equal rewards: the pair is skipped).

One optimizer step (SGD lr 1, no clipping) on fixed pairs of chosen lengths and rewards; the reference
is the initial policy, so its log-probs are the policy's own at the start (detached).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hand_helpers import assert_same_update, hand_update, shaped_rollouts, step_update, table_reward

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.methods.online_dpo import OnlineDPO
from lightning_vlm.models.vlm import VLM

BETA = 0.1
LENGTHS = [2, 5, 6, 3, 4, 1, 3, 6]
# pairs: (finished, truncated), (truncated, finished), (finished, finished), (finished, finished)
FINISHED = [True, False, False, True, True, True, True, True]
REWARDS = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 0.0, 3.0]


@pytest.fixture(scope="module")
def setup(tiny_path):
    path = tiny_path("qwen2_5_vl")
    rows = synthetic_rows("prompt", 4, seed=5)
    rollouts = shaped_rollouts(VLM(path), rows, 2, LENGTHS, FINISHED, seed=1)
    return path, rows, rollouts


def penalised(penalty: float | None) -> list[float]:
    """TRL's missing_eos_penalty: subtracted from the reward of every completion without an end of turn."""
    return [r - (penalty or 0.0) * (not done) for r, done in zip(REWARDS, FINISHED, strict=True)]


def pairs_by_hand(rewards: list[float]) -> list[tuple[int, int]]:
    """(chosen, rejected) completion indices of the pairs whose rewards differ; ties are skipped."""
    out = []
    for p in range(len(rewards) // 2):
        a, b = 2 * p, 2 * p + 1
        if rewards[a] != rewards[b]:
            out.append((a, b) if rewards[a] > rewards[b] else (b, a))
    return out


def dpo_loss_by_hand(loss_type: str, pairs: list[tuple[int, int]]):
    def loss(logps, entropy, mask):
        total = (logps * mask).sum(-1)
        ratio = total - total.detach()  # log π/π_ref of each completion (π_ref: the initial policy)
        per_pair = []
        for c, r in pairs:
            if loss_type == "sigmoid":
                per_pair.append(-F.logsigmoid(BETA * (ratio[c] - ratio[r])))
            else:  # IPO: the summed margin regressed to 1/(2β), as TRL's OnlineDPOTrainer
                per_pair.append((ratio[c] - ratio[r] - 1 / (2 * BETA)) ** 2)
        return torch.stack(per_pair).sum() / len(pairs)

    return loss


@pytest.mark.parametrize(
    ("loss_type", "penalty", "expected_pairs"),
    [
        # ties everywhere but the last pair: (1, 1), (1, 1), (2, 2) are skipped
        ("sigmoid", None, [(7, 6)]),
        # the penalty breaks the first two ties in favour of the finished completion
        ("sigmoid", 0.5, [(0, 1), (3, 2), (7, 6)]),
        ("ipo", 0.5, [(0, 1), (3, 2), (7, 6)]),
        ("ipo", None, [(7, 6)]),
    ],
    ids=["sigmoid-ties", "sigmoid-eos_penalty", "ipo-eos_penalty", "ipo-ties"],
)
# The sampling temperature shapes only the sampling: the loss's log-probs are the policy's own (T = 1),
# as in TRL's OnlineDPOTrainer. They were divided by it, which changed the loss and its effective beta.
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_online_dpo_step_follows_the_loss_penalty_and_skips_ties(
    setup, loss_type, penalty, expected_pairs, temperature
):
    path, rows, rollouts = setup
    pairs = pairs_by_hand(penalised(penalty))
    assert pairs == expected_pairs
    expected, value = hand_update(path, rollouts, dpo_loss_by_hand(loss_type, pairs))
    update, metrics = step_update(path, OnlineDPO, rows, rollouts, reward_funcs=[table_reward(rollouts, REWARDS)],
                                  loss_type=loss_type, missing_eos_penalty=penalty, beta=BETA,
                                  sampling={"temperature": temperature})  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/valid_pair_frac"] == pytest.approx(len(pairs) / 4)
    # policy == reference at the first step: every margin is 0
    assert value == pytest.approx(25.0 if loss_type == "ipo" else 0.6931472, rel=1e-5)
    assert metrics["train/loss"] == pytest.approx(value, rel=1e-5)
    # Ties of the implicit reward count half, as in DPO (losses.preference.reward_accuracy).
    assert metrics["train/rewards/accuracies"] == pytest.approx(0.5)


def test_masked_truncated_completions_make_no_pair(setup):
    # With mask_truncated_completions a truncated answer is no evidence: its log-probs were masked to 0,
    # but its pair still trained, pushing the finished answer up against nothing (a one-sided DPO term).
    path, rows, rollouts = setup
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 0.0, 3.0]  # the first two pairs: (finished, truncated), ...
    pairs = [(7, 6)]  # ... the third a tie: one pair left
    expected, _ = hand_update(path, rollouts, dpo_loss_by_hand("sigmoid", pairs))
    update, metrics = step_update(path, OnlineDPO, rows, rollouts, reward_funcs=[table_reward(rollouts, rewards)],
                                  beta=BETA, mask_truncated_completions=True)  # fmt: skip
    assert_same_update(update, expected)
    assert metrics["train/valid_pair_frac"] == pytest.approx(1 / 4)
    # missing_eos_penalty makes a truncated answer the rejected one, which the mask leaves out: refused
    with pytest.raises(ValueError, match="mask_truncated_completions.*missing_eos_penalty"):
        OnlineDPO(VLM(path), optimizer=None, missing_eos_penalty=1.0, mask_truncated_completions=True)


def test_candidates_pair_the_best_with_the_worst():
    from lightning_vlm.methods.online_dpo import best_and_worst

    nan = float("nan")
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, nan, 0.0, nan, 1.0])
    # group 0: best index 1 (first of the two 1.0s), worst 0; group 1 all tie: (4, 4), a skipped pair;
    # group 2: NaN is never picked while scored values exist
    assert best_and_worst(rewards, 4) == [1, 0, 4, 4, 11, 9]
    # mask_truncated_completions: a truncated candidate's pair would be dropped, so two finished ones pair
    cut = torch.tensor([False, True, False, False, True] + [False] * 7)
    assert best_and_worst(rewards, 4, cut) == [3, 0, 5, 5, 11, 9]


def test_pair_metrics_are_pooled_over_the_steps_valid_pairs_whatever_the_micro_batches(setup):
    # One pair per micro-batch, three of them ties (skipped): the metrics are those of the one valid pair,
    # as without micro-batches. A mean per micro-batch counted the ties' micro-batches as 0 (0.125).
    path, rows, rollouts = setup
    settings = {"reward_funcs": [table_reward(rollouts, REWARDS)], "beta": BETA}
    _, whole = step_update(path, OnlineDPO, rows, rollouts, **settings)
    _, split = step_update(path, OnlineDPO, rows, rollouts, micro_batch_size=2, **settings)
    assert whole["train/valid_pair_frac"] == split["train/valid_pair_frac"] == pytest.approx(1 / 4)
    assert split["train/rewards/accuracies"] == pytest.approx(0.5)
    for name in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "loss"):
        assert split[f"train/{name}"] == pytest.approx(whole[f"train/{name}"], rel=1e-5, abs=1e-6), name


def test_online_dpo_runs_no_old_policy_pass_under_another_sampler_or_several_steps(setup):
    # Its loss reads the current and the reference log-probs only: neither a vLLM-like sampler (not the
    # policy) nor 2 optimizer steps per generation may cost a third pass over the completions.
    from online_helpers import FixedGenerator, fit_steps, sgd

    path, rows, rollouts = setup
    vlm = VLM(path)
    module = OnlineDPO(vlm, optimizer=sgd(1e-3), num_generations=2, num_candidates=2, beta=BETA,
                       steps_per_generation=2, max_completion_length=max(LENGTHS),
                       reward_funcs=[table_reward(rollouts, REWARDS)])  # fmt: skip
    module.generator = FixedGenerator(rollouts, is_policy=False)
    forwards = []
    # after construction: the reference is a copy made then, without this hook
    vlm.model.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    trainer = fit_steps(module, rows, steps=2)
    assert trainer.global_step == 2 and module.generator.calls == 1
    assert len(forwards) == 2, "one policy forward per optimizer step, none for old log-probs"
    assert not any(k.startswith("train/is_ratio") for k in trainer.callback_metrics)


def test_a_step_without_a_valid_pair_adds_no_zeros_to_the_pair_metrics(setup):
    # Two optimizer steps per generation: the first holds only ties. It logged accuracies, margins and
    # log-probs of 0 (a log-prob of 0 is impossible), averaged in: half the one-step values.
    from online_helpers import FixedGenerator, fit_steps, sgd

    path, rows, rollouts = setup
    # spg 3: steps of 2, 1 and 1 pairs, one pair per micro-batch (steps with unequal micro-batch counts).
    logged = {}
    for spg, micro in ((1, None), (2, None), (3, 2)):
        module = OnlineDPO(VLM(path), optimizer=sgd(0.0), max_grad_norm=None, num_generations=2, num_candidates=2,
                           beta=BETA, steps_per_generation=spg, micro_batch_size=micro,
                           max_completion_length=max(LENGTHS), reward_funcs=[table_reward(rollouts, REWARDS)])  # fmt: skip
        module.generator = FixedGenerator(rollouts)
        logged[spg] = {k: v.item() for k, v in fit_steps(module, rows, steps=spg).callback_metrics.items()}
    assert logged[1]["train/logps/chosen"] < 0
    for spg in (2, 3):
        for name in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
            expected = logged[1][f"train/{name}"]
            assert logged[spg][f"train/{name}"] == pytest.approx(expected, rel=1e-5, abs=1e-6), (spg, name)
