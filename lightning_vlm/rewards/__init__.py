"""Reward functions (plain callables), their weighted scoring, and reward models as reward functions."""

from lightning_vlm.rewards.accuracy import answers_match, extract_answer, normalize
from lightning_vlm.rewards.builtin import (
    BUILTIN_REWARDS,
    accuracy_reward,
    answer_format_reward,
    completion_text,
    length_reward,
    think_format_reward,
)
from lightning_vlm.rewards.reward_model import RewardModel
from lightning_vlm.rewards.scoring import (
    RewardFunctionError,
    RewardScorer,
    describe,
    resolve_reward_function,
    reward_name,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunctionError",
    "RewardModel",
    "RewardScorer",
    "accuracy_reward",
    "answer_format_reward",
    "answers_match",
    "completion_text",
    "describe",
    "extract_answer",
    "length_reward",
    "normalize",
    "resolve_reward_function",
    "reward_name",
    "think_format_reward",
]
