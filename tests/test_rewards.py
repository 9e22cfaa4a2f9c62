"""Reward functions as plain callables: the built-ins and the weighted scorer (reward model: test_reward_model.py)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.rewards import (
    RewardFunctionError,
    RewardScorer,
    accuracy_reward,
    answer_format_reward,
    completion_text,
    giou_reward,
    iou_reward,
    length_reward,
    reward_name,
    think_format_reward,
)

PROMPT = [
    {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "What color?"}]}
]


# ---------------------------------------------------------------- built-in reward functions


def test_accuracy_reward_right_wrong_and_missing_solution():
    completions = ["red", "<think>it is blue</think><answer>Blue</answer>", "green", "red", "3"]
    solution = ["red", "blue", "red", None, 3]
    assert accuracy_reward(completions, solution=solution, prompts=[PROMPT] * 5, extra=[0] * 5) == [
        1.0,
        1.0,
        0.0,
        None,
        1.0,
    ]
    # Empty or NaN references (pandas) are rows without a solution too.
    assert accuracy_reward(["red", "red"], solution=["  ", float("nan")]) == [None, None]


def test_accuracy_reward_takes_a_list_of_accepted_answers():
    # VQA-style solutions: any accepted answer scores (a list was compared as its repr before: always 0)
    solution = [["two", "2"], ["two", "2"], [], [0.1, 0.2, 0.5, 0.6]]
    assert accuracy_reward(["2", "three", "2", "0.5"], solution=solution) == [1.0, 0.0, None, 0.0]


def test_accuracy_reward_without_solution_column_says_so():
    with pytest.raises(ValueError, match=r"`solution` column.*\['answer', 'prompts'\]"):
        accuracy_reward(["red"], prompts=[PROMPT], answer=["red"])


def test_accuracy_reward_on_synthetic_prompt_rows_and_conversational_completions():
    rows = synthetic_rows("prompt", 4, seed=1)
    solutions = [r["solution"] for r in rows]
    right = [[{"role": "assistant", "content": s}] for s in solutions]
    typed = [[{"role": "assistant", "content": [{"type": "text", "text": f"The {s}."}]}] for s in solutions]
    assert accuracy_reward(right, solution=solutions) == [1.0] * 4
    assert accuracy_reward(typed, solution=solutions) == [1.0] * 4
    assert accuracy_reward(["nothing"] * 4, solution=solutions) == [0.0] * 4
    assert completion_text(typed[0]) == f"The {solutions[0]}."


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>red things</think><answer>red</answer>", 1.0),
        ("  <think>\nline one\nline two\n</think>\n\n<answer> red </answer>\n", 1.0),
        ("<think></think><answer>red</answer>", 1.0),
        ("<think>x</think><answer>  </answer>", 0.0),
        ("<answer>red</answer>", 0.0),
        ("<think>x</think>red", 0.0),
        ("I think <think>x</think><answer>red</answer>", 0.0),
        ("<think>x</think><answer>red</answer> trailing", 0.0),
        ("<think>x</think><answer>a</answer><answer>b</answer>", 0.0),
        ("<think>a<think>b</think><answer>red</answer>", 0.0),
        ("<THINK>x</THINK><ANSWER>red</ANSWER>", 0.0),
    ],
)
def test_think_format_reward(completion, expected):
    assert think_format_reward([completion], solution=["red"]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>red</answer>", 1.0),
        ("Let me look. <answer>red</answer>", 1.0),
        ("<think>x</think><answer>red</answer>", 1.0),
        ("<answer></answer>", 0.0),
        ("red", 0.0),
        ("<answer>a</answer><answer>b</answer>", 0.0),
        ("<answer>a<answer>b</answer>", 0.0),
        ("<answer>red", 0.0),
        ("<answer>red</answer></answer>", 0.0),
    ],
)
def test_answer_format_reward(completion, expected):
    assert answer_format_reward([completion]) == [expected]


def test_length_reward_is_dapo_soft_overlong_punishment():
    ids = [[0] * n for n in (0, 6, 7, 8, 9, 10, 11, 50)]
    rewards = length_reward(["x"] * len(ids), completion_ids=ids, max_length=10, cache_length=4)
    assert rewards == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    # A hard cut without a cache; text units when there are no token ids.
    assert length_reward(["abc", "abcd"], max_length=3, unit="chars") == [0.0, -1.0]
    assert length_reward(["a b", "a b c", "a b c d e"], max_length=4, cache_length=2, unit="words") == [
        0.0,
        -0.5,
        -1.0,
    ]


def test_length_reward_settings_are_checked():
    with pytest.raises(ValueError, match="completion_ids"):
        length_reward(["abc"], max_length=3)
    with pytest.raises(ValueError, match="unit"):
        length_reward(["abc"], max_length=3, unit="bytes")
    with pytest.raises(ValueError, match="cache_length"):
        length_reward(["abc"], max_length=3, cache_length=4, unit="chars")


# ---------------------------------------------------------------- scorer


def _constant(values):
    def constant(completions, **kwargs):
        return list(values)

    return constant


def test_scorer_weights_and_nan_handling():
    first = _constant([1.0, None, None, 0.5])
    second = _constant([2.0, 3.0, None, float("nan")])
    scorer = RewardScorer({"a": first, "b": second}, weights=[1.0, 0.5])
    per_function, names = scorer(["w", "x", "y", "z"], {"solution": ["r"] * 4})
    assert names == ["a", "b"]
    assert per_function.dtype == torch.float32 and per_function.shape == (4, 2)
    assert per_function[1, 0].isnan() and per_function[2].isnan().all() and per_function[3, 1].isnan()
    total = scorer.total(per_function)
    assert total[[0, 1, 3]].tolist() == [2.0, 1.5, 0.5]
    assert math.isnan(total[2].item())


def test_scorer_weights_by_name_default_to_one():
    scorer = RewardScorer({"a": _constant([1.0]), "b": _constant([2.0])}, weights={"b": -1.0})
    assert scorer.total(scorer([""])[0]).tolist() == [-1.0]
    with pytest.raises(ValueError, match=r"unknown functions \['c'\]"):
        RewardScorer({"a": _constant([1.0])}, weights={"c": 1.0})
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        RewardScorer([_constant([1.0])], weights=[1.0, 2.0])


def test_scorer_passes_prompts_and_columns_by_keyword():
    seen = {}

    def trl_style(prompts, completions, solution, **kwargs):
        seen.update(prompts=prompts, solution=solution, extra=kwargs)
        return [1.0] * len(completions)

    scorer = RewardScorer([trl_style, accuracy_reward, think_format_reward])
    completions = ["<think>hm</think><answer>red</answer>", "blue"]
    columns = {"prompts": [PROMPT, PROMPT], "solution": ["red", "red"], "image_id": [7, 8]}
    per_function, names = scorer(completions, columns)
    assert names == ["trl_style", "accuracy_reward", "think_format_reward"]
    assert per_function.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert seen == {"prompts": [PROMPT, PROMPT], "solution": ["red", "red"], "extra": {"image_id": [7, 8]}}


def test_scorer_accepts_numpy_torch_and_bool_results():
    scorer = RewardScorer(
        [
            lambda completions, **kw: np.array([0.5, 1.0]),
            lambda completions, **kw: torch.tensor([1, 0]),
            lambda completions, **kw: [True, np.float32(0.25)],
        ]
    )
    per_function, names = scorer(["a", "b"])
    assert names == ["<lambda>", "<lambda>_2", "<lambda>_3"]
    assert per_function.tolist() == [[0.5, 1.0, 1.0], [1.0, 0.0, 0.25]]


def test_partials_are_named_after_their_function():
    short = functools.partial(length_reward, max_length=5, unit="chars")
    nested = functools.partial(functools.partial(length_reward, unit="chars"), max_length=8)
    assert reward_name(short) == "length_reward"
    scorer = RewardScorer([short, nested, "accuracy_reward", "lightning_vlm.rewards.think_format_reward"])
    assert scorer.names == ["length_reward", "length_reward_2", "accuracy_reward", "think_format_reward"]

    # a function already named like a renamed duplicate keeps its name; the duplicate takes the next
    def f(completions, **kwargs):
        return [1.0 for _ in completions]

    def f_2(completions, **kwargs):
        return [2.0 for _ in completions]

    assert RewardScorer([f, f, f_2]).names == ["f", "f_3", "f_2"]
    per_function, _ = scorer(["abcdef"], {"solution": ["abcdef"]})
    assert per_function.tolist() == [[-1.0, 0.0, 1.0, 0.0]]


def test_hydra_partial_targets_are_scored():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "_target_": "lightning_vlm.rewards.RewardScorer",
            "functions": {
                "accuracy": {"_target_": "lightning_vlm.rewards.accuracy_reward", "_partial_": True},
                "length": {
                    "_target_": "lightning_vlm.rewards.length_reward",
                    "_partial_": True,
                    "max_length": 3,
                    "unit": "chars",
                },
            },
            "weights": {"length": 0.5},
        }
    )
    scorer = instantiate(cfg)
    assert scorer.names == ["accuracy", "length"]
    assert scorer.total(scorer(["red", "blue"], {"solution": ["red", "red"]})[0]).tolist() == [1.0, -0.5]


def _failing(completions, **kwargs):
    raise KeyError("boom")


def _too_short(completions, **kwargs):
    return [1.0]


def _text(completions, **kwargs):
    return ["1.0"] * len(completions)


def _infinite(completions, **kwargs):
    return [math.inf] * len(completions)


def _scalar(completions, **kwargs):
    return 1.0


def _huge(completions, **kwargs):
    return [1.0, -(10**5000)]  # an int past a float's range, and past int-to-text's 4300 digits


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_failing, r"'_failing' \(test_rewards\._failing\) raised KeyError: 'boom'"),
        (_too_short, r"'_too_short' .* returned 1 rewards for 2 completions"),
        (_text, r"'_text' .* non-number for sample 0: str '1\.0' is not a number"),
        (_infinite, r"'_infinite' .* returned inf for sample 0"),
        (_scalar, r"'_scalar' .* returned float; expected a list"),
        (_huge, r"'_huge' .* returned int too large for a float for sample 1, beyond float32's range"),
        (
            functools.partial(length_reward, max_length=4),
            r"'length_reward' \(lightning_vlm\.rewards\.builtin\.length_reward with max_length=4\) "
            r"raised ValueError: .*completion_ids",
        ),
    ],
)
def test_errors_name_the_function(fn, message):
    scorer = RewardScorer([fn])
    with pytest.raises(RewardFunctionError, match=message) as info:
        scorer(["a", "b"], {"solution": ["a", "b"]})
    if fn is _failing:
        assert isinstance(info.value.__cause__, KeyError)
    if fn is _huge:  # a raw OverflowError named no function
        assert isinstance(info.value.__cause__, OverflowError)


def test_scorer_rejects_misaligned_columns_and_bad_specs():
    scorer = RewardScorer([accuracy_reward])
    with pytest.raises(ValueError, match="column 'solution' has 1 entries for 2"):
        scorer(["a", "b"], {"solution": ["a"]})
    with pytest.raises(ValueError, match="RewardModel"):
        RewardScorer(["org/some-reward-model"])
    with pytest.raises(ValueError, match="at least one"):
        RewardScorer([])


def test_missing_cells_of_every_kind_are_rows_without_a_solution():
    import numpy as np

    pd = pytest.importorskip("pandas")
    missing = [np.float32("nan"), np.float64("nan"), pd.NA, pd.NaT, "", None]
    assert accuracy_reward(["nan"] * len(missing), solution=missing) == [None] * len(missing)


def test_think_format_reward_reads_a_completion_after_a_prefilled_think(tiny_path):
    # Thinking templates (Qwen3-VL-Thinking) end the generation prompt with "<think>\n": completions start
    # inside the think block, and every one scored 0, as in TRL.
    from lightning_vlm.generation.base import Rollouts
    from lightning_vlm.methods.grpo import GRPO
    from lightning_vlm.models import chat_render
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(tiny_path("qwen2_5_vl"))
    assert vlm.generation_prompt == "<|im_start|>assistant\n"  # no prefill: completions read as they are
    template = vlm.processor.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"
    )
    assert template != vlm.processor.chat_template
    vlm.processor.chat_template = vlm.tokenizer.chat_template = template
    vlm.generation_prompt = chat_render.generation_prompt(vlm.processor)
    assert vlm.generation_prompt == "<|im_start|>assistant\n<think>\n"
    completions = ["red things</think><answer>red</answer>", "<think>x</think><answer>red</answer>", "red"]
    module = GRPO(vlm, optimizer=None, reward_funcs=[think_format_reward], num_generations=3)
    rollouts = Rollouts([{"prompt": "p"}], [[1]] * 3, completions, [False] * 3, num_generations=3)
    scores, _ = module.score(rollouts)
    assert scores[:, 0].tolist() == [1.0, 0.0, 0.0]  # a second <think> is a nested tag
    assert think_format_reward(completions) == [0.0, 1.0, 0.0]  # no prefill


def test_a_box_whose_area_overflows_gets_the_floor_not_nan():
    # 1e200 squared is inf: GIoU's hull term was inf / inf, NaN, which the trainer reads as "unscored"
    # the last: a finite area (9.4e304) whose hull with the solution is not
    huge = [
        "[0, 0, 1e200, 1e200]",
        "[0, 0, 1e308, 1e308]",
        "[0, 0, 1e400, 5]",
        "[0, 1e160, 1e160, 1.000000000000001e160]",
    ]
    for reward in (giou_reward, iou_reward):
        assert reward(huge, solution=["[28, 0, 56, 28]"] * 4) == [0.0] * 4, reward.__name__
