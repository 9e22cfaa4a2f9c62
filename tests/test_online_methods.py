"""The online-RL loop on the tiny model: accumulation invariance, None rewards, errors, IS correction."""

from __future__ import annotations

import logging

import pytest
import torch
from online_helpers import FixedGenerator, fit_steps, sample_rollouts, sgd, token_reward_fn

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.losses.advantages import group_advantages
from lightning_vlm.methods.grpo import GRPO
from lightning_vlm.methods.online_dpo import OnlineDPO
from lightning_vlm.methods.rloo import RLOO
from lightning_vlm.methods.step_layout import index_chunks, rank_chunks
from lightning_vlm.models.vlm import VLM
from lightning_vlm.parallel.collectives import Shard
from lightning_vlm.rewards.scoring import RewardFunctionError


@pytest.fixture(scope="module")
def rows():
    return synthetic_rows("prompt", 2, seed=3)


def _updated_params(tiny_path, cls, rows, rollouts, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    vlm = VLM(tiny_path("qwen2_5_vl"))
    before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
    kwargs.setdefault("reward_funcs", [token_reward_fn])
    module = cls(vlm, optimizer=sgd(), max_grad_norm=None, num_generations=rollouts.num_generations,
                 max_completion_length=6, **kwargs)  # fmt: skip
    module.generator = FixedGenerator(rollouts)
    fit_steps(module, rows)
    return {n: p.detach() - before[n] for n, p in vlm.named_parameters()}


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (GRPO, {"loss_type": "dapo"}),
        (GRPO, {"loss_type": "grpo", "beta": 0.1}),
        (GRPO, {"loss_type": "dr_grpo", "importance_sampling_level": "sequence"}),
        (RLOO, {"beta": 0.05}),
        (
            OnlineDPO,
            {
                "reward_funcs": [
                    lambda completions, completion_ids, **kw: [float(sum(c) % 3) for c in completion_ids]
                ],
                "num_candidates": 2,
            },
        ),
    ],
)
def test_micro_batch_1_x_4_equals_4_x_1(tiny_path, rows, cls, kwargs):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    generations = 2
    rollouts = sample_rollouts(vlm, rows, generations)
    small = 2 if cls is OnlineDPO else 1  # Online DPO keeps pairs together
    one = _updated_params(tiny_path, cls, rows, rollouts, micro_batch_size=small, **kwargs)
    four = _updated_params(tiny_path, cls, rows, rollouts, micro_batch_size=4, **kwargs)
    moved = max(d.abs().max().item() for d in four.values())
    assert moved > 1e-4, "the step must change the weights for the comparison to mean anything"
    for name in four:
        torch.testing.assert_close(one[name], four[name], atol=2e-6, rtol=1e-4, msg=name)


def test_none_rewards_get_zero_advantage_and_leave_the_group_statistics(tiny_path, rows):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    rollouts = sample_rollouts(vlm, rows, 4)
    seen = {}

    def some_none(completions, completion_ids, **kwargs):
        return [None if i % 4 == 0 else float(sum(ids) % 5 + i) for i, ids in enumerate(completion_ids)]

    module = GRPO(
        vlm, optimizer=sgd(1e-3), reward_funcs=[some_none], num_generations=4, max_completion_length=6
    )
    module.generator = FixedGenerator(rollouts)
    original = module.compute_advantages

    def spy(batch):
        seen["rewards"], seen["advantages"] = batch.rewards.clone(), original(batch).clone()
        return seen["advantages"]

    module.compute_advantages = spy
    fit_steps(module, rows)
    rewards, adv = seen["rewards"], seen["advantages"]
    assert rewards[::4].isnan().all() and (adv[::4] == 0).all()
    for g in range(2):
        valid = rewards[g * 4 + 1 : g * 4 + 4]
        expected = group_advantages(valid, 3)
        torch.testing.assert_close(adv[g * 4 + 1 : g * 4 + 4], expected)


def test_a_failing_reward_function_is_named(tiny_path, rows):
    vlm = VLM(tiny_path("qwen2_5_vl"))

    def broken_reward(completions, **kwargs):
        raise KeyError("no_such_column")

    module = GRPO(
        vlm, optimizer=sgd(), reward_funcs=[broken_reward], num_generations=2, max_completion_length=4
    )
    with pytest.raises(RewardFunctionError, match="broken_reward"):
        fit_steps(module, rows)


def test_logged_step_statistics_keep_no_graph(tiny_path, rows, monkeypatch):
    # The entropy kept its autograd graph until the generation's end: with the checkpointed log-prob chunks
    # recomputed in backward, [tokens, vocabulary] tensors per micro-batch (GBs at real sizes)
    import lightning_vlm.methods.online as online

    logged, log_synced = [], online.log_synced

    def spy(module, values, batch_size):
        logged.append({k: v for k, v in values.items() if torch.is_tensor(v) and v.requires_grad})
        return log_synced(module, values, batch_size)

    monkeypatch.setattr(online, "log_synced", spy)
    module = RLOO(VLM(tiny_path("qwen2_5_vl")), optimizer=sgd(0.1), reward_funcs=[token_reward_fn],
                  num_generations=2, max_completion_length=4, steps_per_generation=2, micro_batch_size=1)  # fmt: skip
    fit_steps(module, rows, steps=2)
    assert logged and logged == [{}] * len(logged)


@pytest.mark.parametrize(("first", "warned"), [(3, True), (2, False)])
def test_a_resume_inside_a_generation_cut_by_max_steps_is_warned_of(
    first, warned, tiny_path, rows, tmp_path, caplog
):
    # 2 optimizer steps a generation: max_steps=3 stops generation 2 after its first step, and its rollouts
    # are not in the checkpoint, so the resumed run trains a new generation where one straight run would not
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_vlm.data.skips import collate_rows

    def module():
        return GRPO(VLM(tiny_path("qwen2_5_vl")), optimizer=sgd(0.1), reward_funcs=[token_reward_fn],
                    num_generations=2, max_completion_length=4, steps_per_generation=2)  # fmt: skip

    trainer = fit_steps(module(), rows, steps=first)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    resumed = L.Trainer(accelerator="cpu", max_steps=first + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with caplog.at_level("WARNING"):
        resumed.fit(module(), DataLoader(rows, batch_size=len(rows), collate_fn=collate_rows),
                    ckpt_path=tmp_path / "end.ckpt", weights_only=False)  # fmt: skip
    assert ("ended a generation before its last optimizer step" in caplog.text) == warned


def test_a_run_by_epochs_clears_the_cut_generation_mark(tiny_path, rows):
    # Set only under max_steps: resumed by epochs (max_steps=-1), the mark stayed, and every later
    # checkpoint warned of a cut generation
    module = GRPO(VLM(tiny_path("qwen2_5_vl")), optimizer=sgd(0.1), reward_funcs=[token_reward_fn],
                  num_generations=2, max_completion_length=4, steps_per_generation=2)  # fmt: skip
    module._generation_cut = True  # as loaded from a checkpoint that max_steps cut
    fit_steps(module, rows, steps=-1, max_epochs=1)
    assert module._generation_cut is False


def test_reward_models_in_reward_funcs_go_to_the_policy_s_device(tiny_path, rows):
    # Only method.reward_model was moved: one in reward_funcs, or routed by a TaskReward, scored on the CPU
    from lightning_vlm.rewards.routing import TaskReward

    class Scorer:
        """A reward holding a model: records where it was moved."""

        __name__ = "scorer"

        def __init__(self) -> None:
            self.devices = []

        def to(self, device):
            self.devices.append(str(device))
            return self

        def __call__(self, completions, **kwargs):
            return [0.5] * len(completions)

    plain, routed = Scorer(), Scorer()
    module = GRPO(VLM(tiny_path("qwen2_5_vl")), optimizer=sgd(0.1), num_generations=2, max_completion_length=4,
                  reward_funcs=[plain, TaskReward(routed, task="count", column="kind"), token_reward_fn])  # fmt: skip
    fit_steps(module, [{**r, "kind": "count"} for r in rows])
    assert plain.devices == routed.devices == ["cpu"]


def test_reward_functions_are_called_as_trl_calls_them(tiny_path, rows):
    # TRL's reward functions for conversational data read c[0]["content"] and may take trainer_state
    vlm = VLM(tiny_path("qwen2_5_vl"))
    seen = []

    def trl_style(completions, trainer_state, prompts, **kwargs):
        state = trainer_state
        seen.append((state.global_step, state.epoch, state.max_steps, prompts[0][0]["role"]))
        return [float(len(c[0]["content"])) for c in completions]

    module = GRPO(vlm, optimizer=sgd(), reward_funcs=[trl_style], num_generations=2, max_completion_length=4)
    fit_steps(module, rows, steps=2)
    assert seen == [(0, 0.0, 2, "user"), (1, 1.0, 2, "user")]  # a generation per step (an epoch: one batch)
    # By epochs (max_steps=-1), TRL's max_steps is still the run's length: 2 epochs x 1 batch x 2 steps each
    seen.clear()
    module = GRPO(vlm, optimizer=sgd(), reward_funcs=[trl_style], num_generations=2, max_completion_length=4,
                  steps_per_generation=2)  # fmt: skip
    fit_steps(module, rows, steps=-1, max_epochs=2)
    assert seen == [(0, 0.0, 4, "user"), (2, 1.0, 4, "user")]


@pytest.mark.parametrize(
    ("cls", "kwargs", "setting"),
    [
        (GRPO, {"loss_type": "mean"}, "loss_type"),
        (GRPO, {"importance_sampling_level": "batch"}, "importance_sampling_level"),
        (GRPO, {"scale_rewards": "std"}, "scale_rewards"),
        (GRPO, {"num_generations": 0}, "num_generations"),
        (GRPO, {"vllm_importance_sampling_mode": "seq"}, "importance sampling mode"),
        (GRPO, {"max_completion_length": 8, "sampling": None}, None),
        (RLOO, {"num_generations": 1}, "num_generations"),
        (OnlineDPO, {"num_generations": 4}, "num_generations"),
        (OnlineDPO, {"loss_type": "hinge"}, "loss_type"),
        (OnlineDPO, {"micro_batch_size": 3}, "micro_batch_size"),
    ],
)
def test_bad_settings_name_the_setting(tiny_path, cls, kwargs, setting):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    if setting is None:  # a valid combination: no error
        cls(vlm, optimizer=sgd(), **kwargs)
        return
    with pytest.raises(ValueError, match=setting):
        cls(vlm, optimizer=sgd(), **kwargs)


def test_index_chunks_split_unevenly_into_steps_and_micro_batches():
    def ids(chunks):
        return [[m.tolist() for m in step] for step in chunks]

    assert ids(index_chunks(8, 2, 3)) == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    assert ids(index_chunks(7, 3, 2)) == [[[0, 1], [2]], [[3, 4]], [[5, 6]]]  # the first step takes one more
    assert ids(index_chunks(2, 4, None)) == [[[0]], [[1]]]  # never more steps than completions


def record_steps(module) -> list[list[int]]:
    """The completions of each optimizer step the module's loss is called for, filled as it trains."""
    seen, loss = [], module.loss
    module.loss = lambda batch, index, step, *rest: (
        seen.append(step.index.tolist()) or loss(batch, index, step, *rest)
    )
    return seen


@pytest.mark.parametrize(("prompts", "steps"), [(2, [[0, 1], [2, 3], [4], [5]]), (1, [[0], [1], [2]])])
def test_a_batch_steps_per_generation_does_not_split_trains_each_completion_once(
    tiny_path, rows, prompts, steps, caplog
):
    # An epoch's short last batch: 3 completions a prompt, 4 steps a generation. It used to stop the run.
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=3,
                  steps_per_generation=4, max_completion_length=4)  # fmt: skip
    seen = record_steps(module)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.online"):
        trainer = fit_steps(module, rows[:prompts], steps=len(steps))
    assert trainer.global_step == len(steps) and seen == steps
    said = [r.getMessage() for r in caplog.records if "steps_per_generation" in r.getMessage()]
    assert len(said) == 1 and f"{3 * prompts} completions" in said[0], said


@pytest.mark.parametrize(("prompts", "steps"), [(2, [[0, 1], [2, 3]]), (1, [[0, 1]])])
def test_online_dpo_keeps_each_pair_in_one_step_when_a_batch_does_not_split(tiny_path, rows, prompts, steps):
    # 2 or 1 pairs for 4 steps a generation: one pair a step. Steps of single completions split the
    # pairs, and stopped the run.
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = OnlineDPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_candidates=2,
                       steps_per_generation=4, max_completion_length=4)  # fmt: skip
    seen = record_steps(module)
    trainer = fit_steps(module, rows[:prompts], steps=len(steps))
    assert trainer.global_step == len(steps) and seen == steps


def test_micro_batches_over_the_bound_are_reported_by_the_rank_holding_them(tiny_path, caplog):
    # Ranks of 8 and 1 completions: one pass each, so rank 0's holds all 8 (micro_batch_size=2). Said once.
    module = GRPO(VLM(tiny_path("qwen2_5_vl")), optimizer=sgd(), num_generations=2, micro_batch_size=2)
    shard = Shard((8, 1), 0)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.online"):
        for _ in range(2):
            module._warn_uneven_steps(shard, 1, rank_chunks(shard.sizes, 0, 1, 2))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "rank 0: micro-batches of up to 8 completions" in said[0], said
    assert "[8, 1]" in said[0] and "data.on_bad_row=skip" in said[0]


def test_steps_per_generation_and_iterations_step_the_optimizer_and_report_updates(tiny_path, rows):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=4,
                  steps_per_generation=2, num_iterations=2, max_completion_length=4)  # fmt: skip
    updates = []
    module.on_policy_update = lambda: updates.append(module.trainer.global_step)
    generator = FixedGenerator(sample_rollouts(vlm, rows, 4, max_new_tokens=4))
    module.generator = generator
    trainer = fit_steps(module, rows, steps=8)
    assert generator.calls == 2 and trainer.global_step == 8 and updates == list(range(1, 9))
    # old log-probs were needed (the policy moved inside a generation): the ratio left 1
    assert trainer.callback_metrics["train/ratio/max"] > 1.0


def test_the_generation_and_the_whole_step_are_timed(tiny_path, rows):
    # verl's timing_s/gen and timing_s/step: the generation (with scoring) is part of the step's time
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=4,
                  steps_per_generation=2, max_completion_length=4)  # fmt: skip
    module.generator = FixedGenerator(sample_rollouts(vlm, rows, 4, max_new_tokens=4))
    metrics = fit_steps(module, rows, steps=4).callback_metrics
    assert 0 < metrics["train/timing/rollout_s"] < metrics["train/timing/step_s"]


def test_max_steps_inside_a_generation_stops_there(tiny_path, rows):
    """trainer.max_steps counts optimizer steps: 5 with 4 per generation is one generation and one step
    of the next, not 8 (Lightning checks max_steps only between batches)."""
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=4,
                  steps_per_generation=2, num_iterations=2, max_completion_length=4)  # fmt: skip
    generator = FixedGenerator(sample_rollouts(vlm, rows, 4, max_new_tokens=4))
    module.generator = generator
    trainer = fit_steps(module, rows, steps=5)
    assert generator.calls == 2 and trainer.global_step == 5


def test_ratio_extremes_of_a_generation_do_not_depend_on_micro_batches(tiny_path, rows):
    # ratio/min and ratio/max were weighted means of each micro-batch's extreme: smaller micro-batches
    # hid the off-policy tail they are logged to show.
    logged = {}
    for micro in (1, 4):
        torch.manual_seed(0)
        vlm = VLM(tiny_path("qwen2_5_vl"))
        module = GRPO(vlm, optimizer=sgd(0.5), reward_funcs=[token_reward_fn], num_generations=4, num_iterations=2,
                      max_completion_length=4, micro_batch_size=micro, max_grad_norm=None)  # fmt: skip
        module.generator = FixedGenerator(sample_rollouts(vlm, rows, 4, max_new_tokens=4))
        metrics = fit_steps(module, rows, steps=2).callback_metrics
        logged[micro] = (float(metrics["train/ratio/min"]), float(metrics["train/ratio/max"]))
    low, high = logged[4]
    assert low < 0.99 and high > 1.01, "the second pass must be off-policy for the test to mean anything"
    assert logged[1] == pytest.approx(logged[4], rel=1e-4)


def test_sampler_logprobs_drive_the_importance_correction_when_the_sampler_is_not_the_policy(tiny_path, rows):
    vlm = VLM(tiny_path("qwen2_5_vl"))
    rollouts = sample_rollouts(vlm, rows, 2, max_new_tokens=4)
    # A sampler that believed every token 0.5 nats less likely than the trainer does.
    rollouts.logprobs = [[lp - 0.5 for lp in seq] for seq in rollouts.logprobs]
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=2,
                  max_completion_length=4, vllm_importance_sampling_mode="token_truncate")  # fmt: skip
    module.generator = FixedGenerator(rollouts, is_policy=False)
    trainer = fit_steps(module, rows)
    assert trainer.callback_metrics["train/is_ratio/mean"].item() == pytest.approx(3.0**0 * 1.6487, rel=1e-3)
    # The HF generator samples from the policy itself: no correction, no metric.
    module = GRPO(vlm, optimizer=sgd(1e-3), num_generations=2, max_completion_length=4)
    trainer = fit_steps(module, rows)
    assert "train/is_ratio/mean" not in trainer.callback_metrics


def test_ratio_extremes_of_a_generation_with_no_active_token_are_nan_not_zero(tiny_path, rows):
    # Every completion truncated and masked (mask_truncated_completions): no ratio to describe. The
    # extremes were logged as 0, which reads as a ratio that collapsed.
    vlm = VLM(tiny_path("qwen2_5_vl"))
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[token_reward_fn], num_generations=2,
                  max_completion_length=4, mask_truncated_completions=True)  # fmt: skip
    rollouts = sample_rollouts(vlm, rows, 2, max_new_tokens=4)
    rollouts.truncated = [True] * len(rollouts.truncated)
    module.generator = FixedGenerator(rollouts)
    metrics = fit_steps(module, rows, steps=1).callback_metrics
    for name in ("train/ratio/min", "train/ratio/max"):
        assert torch.isnan(metrics[name]), (name, metrics[name])
