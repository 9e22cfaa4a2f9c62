"""Degenerate settings and rewards (issue 11): each is refused early with a message naming the setting
or the reward function, or warned about saying what happened; never a bare traceback or a silent step.

Three matrices: settings given to train.py (composed like it, run by ``training.train``), objects
built directly, and reward batches that train but must be reported. Cases marked "already clear"
were clear before the issue and are kept so they stay so.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hydra.errors import InstantiationException
from online_helpers import fit_steps, sgd

from helpers import compose_train
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.losses.advantages import SCALE_REWARDS, group_advantages, reward_stats, rloo_advantages
from lightning_vlm.methods.grpo import GRPO
from lightning_vlm.methods.online_dpo import OnlineDPO
from lightning_vlm.methods.online_metrics import MissingRewardWarning, nanstd
from lightning_vlm.methods.rloo import RLOO
from lightning_vlm.methods.sft import SFT
from lightning_vlm.models.vlm import VLM
from lightning_vlm.rewards.scoring import RewardFunctionError, RewardScorer
from lightning_vlm.settings_check import check_settings
from lightning_vlm.training import train

# A few steps of a small job; every case below fails (or is expected to) before the first step.
SMALL = ["logger=none", "callbacks=none", "++tiny_start=random", "trainer.max_steps=1",
         "trainer.enable_progress_bar=false", "data.synthetic.num_train=8", "data.synthetic.num_val=4"]  # fmt: skip
NEW, CLEAR = "new check", "already clear"

TRAIN_CASES = [
    # trainer: Lightning divides by these (ZeroDivisionError at the first step / validation)
    (["trainer.accumulate_grad_batches=0"], ValueError, r"trainer\.accumulate_grad_batches must be", NEW),
    (["method=grpo", "trainer.accumulate_grad_batches=2"], ValueError,
     r"trainer\.accumulate_grad_batches=2.*method\.micro_batch_size", NEW),
    (["trainer.val_check_interval=0"], ValueError, r"trainer\.val_check_interval must be > 0", NEW),
    (["trainer.val_check_interval=0.5"], ValueError, r"trainer\.check_val_every_n_epoch set .* give an integer", NEW),
    # Qwen's pixel limit on another family: transformers dropped it silently, images stayed full size (OOM)
    (["model=tiny_gemma3", "model.processor_kwargs={max_pixels:12544}"], InstantiationException,
     r"model\.processor_kwargs \['max_pixels'\]: Gemma3Processor reads no such setting.*Qwen's.*size", NEW),
    # the validation before training had none to run: IndexError in training.py
    (["validate_before_fit=true", "trainer.limit_val_batches=0"], ValueError,
     r"validate_before_fit=true .*trainer\.limit_val_batches=0", NEW),
    (["method=grpo", "trainer.gradient_clip_val=1.0"], ValueError, r"set method\.max_grad_norm instead", NEW),
    # DeepSpeed does not accumulate an online method's micro-batches; it failed inside the first step
    (["method=grpo", "trainer=deepspeed_zero2", "method.micro_batch_size=8"], ValueError,
     r"method\.micro_batch_size=8 splits each optimizer step's 32 completions .* method\.micro_batch_size=null", NEW),
    # data of another shape than the method's: KeyError: 'prompt' (or 'completion') after the model loaded
    (["method=grpo", "data=sft"], ValueError,
     r"method GRPO trains on prompt rows, but data is SFTDataModule \(sft rows\).*pass data=prompt", NEW),
    (["method=kto", "data=preference"], ValueError, r"KTO trains on unpaired rows.*data=unpaired", NEW),
    # Hydra's own advice for a key DPO lacks made it an online method here, refused naming a setting it has not
    (["method=dpo", "+method.num_generations=3"], InstantiationException,
     r"unexpected keyword argument 'num_generations'", NEW),
    (["trainer.max_steps=-5"], InstantiationException, r"max_steps. must be a non-negative", CLEAR),
    # Lightning's TypeError ("'<' not supported between instances of 'str' and 'int'") named no setting;
    # null is what a user trying to train by epochs writes
    (["trainer.max_steps=abc"], ValueError, r"trainer\.max_steps must be a whole number .*got 'abc'", NEW),
    (["trainer.max_steps=null", "trainer.max_epochs=1"], ValueError, r"trainer\.max_steps .*-1: no step limit", NEW),
    (["trainer.max_epochs=1.5"], ValueError, r"trainer\.max_epochs must be a whole number", NEW),
    # torch's TypeError came from inside configure_optimizers
    (["method.optimizer.lr=abc"], ValueError, r"method\.optimizer\.lr must be a number >= 0, got 'abc'", NEW),
    # found only once fit had started, in a traceback through Lightning's data hooks, naming no setting
    (["data.train=/no/such/train.jsonl"], FileNotFoundError, r"data\.train='/no/such/train\.jsonl': no such file", NEW),
    (["data.val=./no_such_val.jsonl"], FileNotFoundError, r"data\.val='\./no_such_val\.jsonl': no such file", NEW),
    # model: a missing folder read as a malformed hub id ("Repo id must be in the form ...")
    (["model.model_name_or_path=/no/such/dir"], FileNotFoundError,
     r"model\.model_name_or_path='/no/such/dir': the local folder .* does not exist", NEW),
    (["model=qwen2_5_vl", "model.model_name_or_path=/no/such/dir"], FileNotFoundError,
     r"model\.model_name_or_path='/no/such/dir': the local folder", NEW),
    (["model=qwen2_5_vl", "model.model_name_or_path=nobody-lvlm/no-such-model"], InstantiationException,
     r"model\.model_name_or_path='nobody-lvlm/no-such-model' .* cannot be fetched offline", NEW),
    # SFT / DPO: a negative max_length reported as cut image tokens
    (["method.max_length=-5"], InstantiationException, r"method\.max_length must be a whole number > 0 or null, got -5", NEW),
    (["method=dpo", "method.max_length=0"], InstantiationException, r"method\.max_length must be a whole number > 0", NEW),
    # data and optimizer: the DataLoader's and torch's messages named neither setting
    (["data.batch_size=0"], ValueError, r"data\.batch_size must be a whole number > 0", NEW),
    # null made the loader yield single rows (TypeError in the encoder); 2.5 failed in the DataLoader,
    # 1.5 for validation only at the first validation
    (["data.batch_size=null"], ValueError, r"data\.batch_size must be a whole number > 0, got None", NEW),
    (["data.batch_size=2.5"], ValueError, r"data\.batch_size must be a whole number > 0, got 2\.5", NEW),
    (["data.val_batch_size=1.5"], ValueError, r"data\.val_batch_size must be a whole number > 0 or null, got 1\.5", NEW),
    (["method=grpo", "method.max_completion_length=2.5"], ValueError, r"method\.max_completion_length must be a whole number", NEW),
    # failed inside generate at the first step, naming no setting
    (["method=grpo", "method.sampling.repetition_penalty=0"], ValueError,
     r"method\.sampling\.repetition_penalty must be > 0 or null", NEW),
    (["method=rloo", "method.sampling.min_p=2.0"], ValueError, r"method\.sampling\.min_p must be in \[0, 1\]", NEW),
    (["method.optimizer.lr=-1"], ValueError, r"method\.optimizer\.lr must be a number >= 0, got -1", NEW),
    # online sampling: failed in the loss's log-probs or inside generate, after the first generation
    (["method=grpo", "method.sampling.temperature=0"], ValueError, r"method\.sampling\.temperature must be > 0", NEW),
    # greedy through the other switch: every completion of a prompt the same, nothing learned, no error
    (["method=rloo", "method.sampling.do_sample=false"], ValueError, r"method\.sampling\.do_sample must be true", NEW),
    (["method=grpo", "method.sampling.top_p=0"], ValueError, r"method\.sampling\.top_p must be in \(0, 1\]", NEW),
    (["method=grpo", "method.sampling.top_k=-3"], ValueError, r"method\.sampling\.top_k must be >= 0", NEW),
    (["method=grpo", "method.max_completion_length=0"], ValueError, r"method\.max_completion_length must be a whole number > 0", NEW),
    (["method=grpo", "method.val_num_generations=0"], ValueError, r"method\.val_num_generations must be a whole number > 0", NEW),
    (["method=grpo", "method.steps_per_generation=3"], ValueError,
     r"method\.steps_per_generation=3 does not divide the 32 completions .*data\.batch_size=4", NEW),
    # dynamic sampling trains on one round of the pool: 4 groups of 8, not the 12 prompts' 96 (which split)
    (["method=dapo", "method.steps_per_generation=3"], ValueError,
     r"does not divide the 32 completions a generation trains on \(⌈data\.batch_size=12 / "
     r"method\.dynamic_sampling\.max_num_gen_batches=3⌉ = 4 groups", NEW),
    # 8 completions would split into 4 steps, but pairs do not split: 2 pairs cannot make 4 steps
    (["method=online_dpo", "data.batch_size=2", "method.steps_per_generation=4"], ValueError,
     r"method\.steps_per_generation=4 does not divide Online DPO's 2 pairs", NEW),
    (["method=grpo", "method.dynamic_sampling=true"], ValueError,
     r"method\.dynamic_sampling must be a mapping such as \{enabled: true\}", NEW),
    # online methods' constructors
    (["method=grpo", "method.num_generations=0"], InstantiationException, r"num_generations must be >= 1", CLEAR),
    (["method=online_dpo", "method.num_generations=4"], InstantiationException, r"num_generations must be 2", CLEAR),
    (["method=rloo", "method.num_generations=1"], InstantiationException, r"RLOO needs num_generations >= 2", CLEAR),
    (["method=grpo", "method.num_generations=1"], InstantiationException,
     r"GRPO compares completions within a group: num_generations must be >= 2, got 1", NEW),
    (["method=grpo", "method.reward_weights=[1.0,2.0]"], InstantiationException,
     r"reward_weights: got 2 reward weights for 1 reward functions \['accuracy_reward'\]", NEW),
    (["method=grpo", "method.epsilon=-0.1"], InstantiationException, r"epsilon and epsilon_high must be > 0", CLEAR),
    (["method=grpo", "method.beta=-1"], InstantiationException, r"beta must be >= 0, got -1", CLEAR),
    (["method=online_dpo", "method.beta=0"], InstantiationException, r"Online DPO needs beta > 0", CLEAR),
    (["method=online_dpo", "method.beta=[0.1,0.05]"], InstantiationException,
     r"method\.beta is one number .* per-epoch list of betas is not supported\), got \[0\.1, 0\.05\]", NEW),
    (["method=grpo", "method.reward_funcs=[no_such_reward]"], InstantiationException,
     r"'no_such_reward' is neither a built-in reward", CLEAR),
    (["method=dpo", "method.loss_weights=[1.0,2.0]"], InstantiationException, r"loss_weights has 2 entries", CLEAR),
    # issue 13's settings: TRL silently caps cispo at 0.2, and ignores scale_rewards under GDPO
    (["method=grpo", "method.loss_type=cispo"], InstantiationException, r"loss_type=cispo caps .* set method\.epsilon_high", NEW),
    (["method=grpo", "method.multi_objective_aggregation=normalize_then_sum", "method.scale_rewards=batch"],
     InstantiationException, r"scale_rewards='batch' would be ignored", NEW),
    (["method=grpo", "method.delta=0.5"], InstantiationException, r"delta \(two-sided clipping\) must be > 1", NEW),
    (["method=grpo", "method.use_adaptive_entropy=true", "method.entropy_coef=2.0"], InstantiationException,
     r"entropy_coef 2.0 must lie in \[entropy_coef_min, entropy_coef_max\]", NEW),
    (["method=grpo", "method.dynamic_sampling={enabled:true,filter:std}"], InstantiationException,
     r"dynamic_sampling\.filter 'std' is unknown", NEW),
    (["method=dpo", "method.sft_normalization=tokens"], InstantiationException, r"sft_normalization must be one of", NEW),
    (["method=dpo", "method.sft_normalization=token_mean"], InstantiationException, r"applies to the sft term", NEW),
    (["method=dpo", "method.bco_running_delta=false"], InstantiationException, r"applies to the bco_pair term", NEW),
    (["method=dpo", "method.ref_cache_dir=/tmp/refs"], InstantiationException,
     r"method\.ref_cache_dir='/tmp/refs' holds precomputed reference log-probs: set method\.precompute_ref_logps=true", NEW),
    (["method=dpo", "method.loss_type=[hinge]", "method.label_smoothing=0.1"], InstantiationException,
     r"label_smoothing=0.1 applies only to sigmoid and robust", NEW),
    (["method=grpo", "method.use_bias_correction_kl=true"], InstantiationException, r"needs method\.beta > 0", NEW),
    (["method=kto", "method.loss_type=sigmoid"], InstantiationException, r"method\.loss_type must be one of \('kto'", NEW),
    (["method=online_dpo", "method.num_candidates=1"], InstantiationException, r"num_candidates .* must be >= 2", NEW),
    (["method=online_dpo", "method.vllm_importance_sampling_correction=true"], InstantiationException,
     r"set method\.vllm_importance_sampling_correction=false", NEW),
    # Lightning's keyword searches this run's new, empty folder: it would train the initial weights
    (["ckpt_path=best"], FileNotFoundError, r"ckpt_path=best: Lightning looks in this run's own checkpoint", NEW),
    # vLLM's log-probs and the trainer's must describe one distribution for the IS correction
    (["method=grpo", "generation=vllm_colocate", "method.sampling.top_p=0.9"], ValueError,
     r"method\.sampling\.top_p=0\.9 with generation by vLLM and method\.vllm_importance_sampling_correction", NEW),
    (["method=rloo", "generation=vllm_server", "method.sampling.repetition_penalty=1.1"], ValueError,
     r"method\.sampling\.repetition_penalty=1\.1 with generation by vLLM", NEW),
    (["method=grpo", "generation=vllm_colocate", "callbacks.vllm_generation.engine.logprobs_mode=raw_logprobs"],
     ValueError, r"logprobs_mode=raw_logprobs with method\.vllm_importance_sampling_correction=true", NEW),
    # the off-policy mask compares them too: every negative sample would look off-policy
    (["method=grpo", "generation=vllm_colocate", "method.sampling.top_k=20",
      "method.vllm_importance_sampling_correction=false", "method.off_policy_mask_threshold=0.5"], ValueError,
     r"top_k=20 with generation by vLLM and method\.off_policy_mask_threshold=0\.5", NEW),
    # vLLM samples at 0.01 below it; the trainer's log-probs would divide by the temperature set
    (["method=grpo", "generation=vllm_colocate", "method.sampling.temperature=0.005"], ValueError,
     r"temperature=0\.005 with generation by vLLM, which samples at 0\.01", NEW),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "error", "message", "kind"),
    [pytest.param(*case, id=f"{case[3].split()[0]}:{' '.join(case[0])}") for case in TRAIN_CASES],
)
def test_train_py_settings_fail_early_naming_the_setting(
    overrides, error, message, kind, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the uncached hub id must not be looked up online
    cfg = compose_train([*SMALL, *overrides], tmp_path)
    with pytest.raises(error, match=message):
        train(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=grpo", "generation=vllm_colocate", "method.sampling.top_p=0.9",
         "method.vllm_importance_sampling_correction=false"],
        ["method=grpo", "generation=hf", "method.sampling.top_p=0.9", "method.off_policy_mask_threshold=0.5"],
        ["method=online_dpo", "generation=vllm_colocate", "method.sampling.top_k=20"],
    ],
    ids=["vllm-correction-off", "hf", "online-dpo"],
)  # fmt: skip
def test_reshaped_sampling_is_accepted_where_no_vllm_correction_runs(overrides, tmp_path):
    check_settings(compose_train([*SMALL, *overrides], tmp_path))


def test_settings_an_online_loop_can_honour_are_accepted(tmp_path):
    # A fraction of an epoch with epochs validated; DeepSpeed with one backward per step (micro-batches of
    # a whole step, or none); an online method's own clip.
    check_settings(
        compose_train(
            [*SMALL, "trainer.val_check_interval=0.5", "trainer.check_val_every_n_epoch=1"], tmp_path
        )
    )
    for micro in ("32", "null"):
        check_settings(compose_train(
            [*SMALL, "method=grpo", "trainer=deepspeed_zero2", f"method.micro_batch_size={micro}"], tmp_path
        ))  # fmt: skip
    check_settings(compose_train([*SMALL, "method=grpo", "method.max_grad_norm=0.5"], tmp_path))
    # 0 is Lightning's "no clipping", which manual optimisation accepts
    check_settings(compose_train([*SMALL, "method=grpo", "trainer.gradient_clip_val=0"], tmp_path))
    check_settings(
        compose_train([*SMALL, "method=grpo", "method.sampling.temperature=0.005"], tmp_path)
    )  # HF
    # Online DPO's log-probs are at temperature 1 whatever it samples at (a review of the check above)
    check_settings(compose_train(
        [*SMALL, "method=online_dpo", "generation=vllm_colocate", "method.sampling.temperature=0.005"], tmp_path
    ))  # fmt: skip


def test_a_missing_checkpoint_is_named_before_anything_is_built(tmp_path):
    # Found after the model loaded and the W&B run started, it cost minutes for a large model.
    with pytest.raises(FileNotFoundError, match=r"ckpt_path='/no/such/last.ckpt': no such file"):
        check_settings(compose_train([*SMALL, "ckpt_path=/no/such/last.ckpt"], tmp_path))
    with pytest.raises(ValueError, match=r"ckpt_path='s3://b/last.ckpt' is a URL"):
        check_settings(compose_train([*SMALL, "ckpt_path=s3://b/last.ckpt"], tmp_path))


def test_dynamic_sampling_steps_need_to_split_one_round_not_the_whole_pool(tmp_path):
    # 9 prompts in 2 rounds: a step trains on 5 groups of 2 (10 completions, 5 steps of 2); the pool's
    # 18 would not split into 5, and this used to be refused.
    overrides = ["method=dapo", "data.batch_size=9", "method.num_generations=2", "method.steps_per_generation=5",
                 "method.dynamic_sampling.max_num_gen_batches=2"]  # fmt: skip
    check_settings(compose_train([*SMALL, *overrides], tmp_path))


def test_correction_settings_are_named_when_hf_generate_samples(tmp_path, caplog):
    # With HF generate the policy samples: the correction's mode and bounds are never read.
    mode = ["method=rloo", "method.vllm_importance_sampling_mode=sequence_truncate",
            "method.vllm_importance_sampling_clip_max=5.0"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        check_settings(compose_train([*SMALL, *mode], tmp_path))
    assert "method.vllm_importance_sampling_mode='sequence_truncate', method.vllm_importance_sampling_clip_max=5.0: " \
        "these do nothing with generation by HF generate" in caplog.text  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        check_settings(compose_train([*SMALL, *mode, "generation=vllm_colocate"], tmp_path))
        check_settings(compose_train([*SMALL, "method=grpo"], tmp_path))  # the defaults: nothing to say
    assert "these do nothing" not in caplog.text


@pytest.fixture(scope="module")
def vlm(tiny_path):
    return VLM(tiny_path("qwen2_5_vl"))


def _huge_reward(completions, **kwargs):
    return [1e39 for _ in completions]


def _near_limit_reward(completions, **kwargs):
    return [3e38 for _ in completions]


def _near_limit_too(completions, **kwargs):
    return [2e38 for _ in completions]


DIRECT_CASES = [
    (lambda vlm, tmp: VLM("/no/such/dir"), FileNotFoundError,
     r"model\.model_name_or_path='/no/such/dir': the local folder"),
    (lambda vlm, tmp: VLM(str(tmp / "weights.bin")), FileNotFoundError, r"model\.model_name_or_path=.* is a file"),
    (lambda vlm, tmp: SFT(vlm, optimizer=sgd(), max_length=-5), ValueError, r"method\.max_length must be a whole number > 0"),
    (lambda vlm, tmp: RewardScorer(["accuracy_reward"], [1.0, 2.0]), ValueError, r"reward_weights: got 2"),
    (lambda vlm, tmp: RewardScorer(["no_such_reward"]), ValueError, r"'no_such_reward' is neither"),
    (lambda vlm, tmp: GRPO(vlm, optimizer=sgd(), num_generations=0), ValueError, r"num_generations must be >= 1"),
    (lambda vlm, tmp: GRPO(vlm, optimizer=sgd(), sampling={"do_sample": False}), ValueError, r"sampling\.do_sample=true"),
    (lambda vlm, tmp: RLOO(vlm, optimizer=sgd(), num_generations=1), ValueError, r"num_generations >= 2"),
    (lambda vlm, tmp: GRPO(vlm, optimizer=sgd(), num_generations=1), ValueError, r"num_generations must be >= 2"),
    (lambda vlm, tmp: OnlineDPO(vlm, optimizer=sgd(), micro_batch_size=3), ValueError, r"micro_batch_size must be even"),
    (lambda vlm, tmp: OnlineDPO(vlm, optimizer=sgd(), vllm_importance_sampling_correction=True), ValueError,
     r"Online DPO applies no importance-sampling correction"),
    (lambda vlm, tmp: group_advantages(torch.zeros(8), 3), ValueError, r"groups of num_generations=3"),
    # a reward beyond float32 (the scores' dtype) would become inf there; a weighted total too
    (lambda vlm, tmp: RewardScorer([_huge_reward])(["a", "b"]), RewardFunctionError,
     r"'_huge_reward' .* returned 1e\+39 for sample 0, beyond float32's range"),
    (lambda vlm, tmp: (lambda s: s.total(s(["a"])[0]))(RewardScorer([_near_limit_reward, _near_limit_too])),
     RewardFunctionError, r"weighted reward of sample 0 \(5e\+38: _near_limit_reward: 1 × 3e\+38, _near_limit_too"),
]  # fmt: skip


DIRECT_IDS = ["vlm-missing-folder", "vlm-file", "sft-max_length", "scorer-weights", "scorer-unknown-name",
              "grpo-num_generations", "grpo-greedy", "rloo-num_generations", "grpo-group-of-one",
              "online_dpo-odd-micro_batch",
              "online_dpo-is-correction",
              "groups-not-dividing", "reward-beyond-float32", "weighted-total-beyond-float32"]  # fmt: skip


@pytest.mark.parametrize(("build", "error", "message"), DIRECT_CASES, ids=DIRECT_IDS)
def test_direct_construction_fails_naming_the_setting_or_function(build, error, message, vlm, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(error, match=message):
        build(vlm, tmp_path)


def _none_reward(completions, **kwargs):
    return [None] * len(completions)


def _nan_reward(completions, **kwargs):
    return [math.nan] * len(completions)


def _length_reward(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


WARNING_CASES = [
    # (method, reward functions, expected share of unscored completions, functions named as silent)
    (GRPO, [_none_reward], 1.0, ["_none_reward"]),
    (GRPO, [_none_reward, _nan_reward], 1.0, ["_none_reward", "_nan_reward"]),
    (OnlineDPO, [_none_reward], 1.0, ["_none_reward"]),
    (RLOO, [_nan_reward], 1.0, ["_nan_reward"]),
    # one function with nothing to say (a multi-task reward) while another scores: trains, no warning
    (GRPO, [_none_reward, _length_reward], 0.0, None),
]


@pytest.mark.parametrize(("cls", "funcs", "fraction", "silent"), WARNING_CASES,
                         ids=["grpo-none", "grpo-none+nan", "online_dpo-none", "rloo-nan", "partly-none"])  # fmt: skip
def test_unscored_batches_are_warned_about_and_logged(cls, funcs, fraction, silent, vlm, caplog):
    rows = synthetic_rows("prompt", 2, seed=3)
    module = cls(vlm, optimizer=sgd(1e-3), reward_funcs=funcs, num_generations=2, max_completion_length=4)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.online_metrics"):
        trainer = fit_steps(module, rows)
    assert trainer.callback_metrics["train/frac_reward_none"].item() == fraction
    warnings = [r.getMessage() for r in caplog.records if "returned None (or NaN)" in r.getMessage()]
    if silent is None:
        assert not warnings
        return
    (message,) = warnings
    assert "100% of the completions (the whole batch" in message
    assert f"the whole batch: {silent}" in message and "train/frac_reward_none" in message
    assert math.isfinite(trainer.callback_metrics["train/loss"].item())


def test_the_warning_repeats_at_most_every_n_steps_with_a_count(caplog):
    warner = MissingRewardWarning(every_n_steps=50)
    unscored = {"frac_reward_none": torch.tensor(0.25), "rewards/f/mean": torch.tensor(math.nan)}
    scored = {"frac_reward_none": torch.tensor(0.0), "rewards/f/mean": torch.tensor(1.0)}
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.online_metrics"):
        warned = [s for s in range(120) if warner.check(unscored if s % 2 == 0 else scored, ["f"], s)]
    assert warned == [0, 50, 100]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "25% of the completions;" in messages[0]
    # steps 2, 4, ..., 50 since the first warning: 25 steps with unscored completions
    assert "since the warning at step 0: 25" in messages[1]


@pytest.mark.parametrize("scale", SCALE_REWARDS)
def test_rewards_near_float32s_limit_give_finite_advantages_and_statistics(scale):
    rewards = torch.tensor([1e38, 0.0, 3e38, -3e38, 1.0, 2.0, 2e38, 2e38])
    advantages = group_advantages(rewards, 4, scale)
    assert advantages.dtype == torch.float32 and advantages.isfinite().all()
    assert (advantages[:4] != 0).all(), "the huge rewards must still rank their group's completions"
    assert advantages[0] > advantages[1] and advantages[2] > advantages[0]
    assert rloo_advantages(rewards, 4, normalize=True).isfinite().all()
    mean, std = reward_stats(rewards.view(-1, 1))
    assert mean.isfinite().all() and std.isfinite().all() and nanstd(rewards).isfinite()


def _huge_but_finite_reward(completions, completion_ids, **kwargs):
    return [1e38 * (i % 2) for i in range(len(completion_ids))]


def test_a_1e38_reward_trains_with_finite_logged_statistics(vlm):
    rows = synthetic_rows("prompt", 2, seed=3)
    module = GRPO(vlm, optimizer=sgd(1e-3), reward_funcs=[_huge_but_finite_reward], num_generations=2,
                  max_completion_length=4)  # fmt: skip
    metrics = fit_steps(module, rows).callback_metrics
    for key in ("train/reward", "train/reward_std", "train/advantages/std", "train/loss"):
        assert math.isfinite(metrics[key].item()), key
    # each group holds a 0 and a 1e38: scaled advantages of about ±0.707, not 0 from an inf std
    assert metrics["train/advantages/abs_mean"].item() == pytest.approx(2**-0.5, rel=1e-3)


def test_the_settings_check_imports_on_its_own():
    # settings_check -> data -> datamodule -> settings_check.check_count: an ImportError unless something
    # had imported the data package first
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import lightning_vlm.settings_check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
