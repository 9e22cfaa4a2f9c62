"""Reward functions (plain callables), their weighted scoring, and reward models as reward functions."""

from lightning_vlm.rewards.accuracy import answers_match, extract_answer, normalize
from lightning_vlm.rewards.answers import count_reward, numeric_reward, parse_count, parse_number
from lightning_vlm.rewards.boxes import box_giou, box_iou, giou_reward, iou_reward, parse_box
from lightning_vlm.rewards.builtin import (
    BUILTIN_REWARDS,
    accuracy_reward,
    answer_format_reward,
    completion_text,
    length_reward,
    think_format_reward,
)
from lightning_vlm.rewards.choices import multiple_choice_reward, parse_choice
from lightning_vlm.rewards.ocr import levenshtein, ocr_reward, ocr_similarity
from lightning_vlm.rewards.reward_model import RewardModel
from lightning_vlm.rewards.routing import TaskReward
from lightning_vlm.rewards.scoring import (
    RewardFunctionError,
    RewardScorer,
    describe,
    resolve_reward_function,
    reward_name,
)

__all__ = [
    "box_giou",
    "box_iou",
    "count_reward",
    "giou_reward",
    "iou_reward",
    "levenshtein",
    "multiple_choice_reward",
    "numeric_reward",
    "ocr_reward",
    "ocr_similarity",
    "parse_box",
    "parse_choice",
    "parse_count",
    "parse_number",
    "BUILTIN_REWARDS",
    "RewardFunctionError",
    "RewardModel",
    "RewardScorer",
    "TaskReward",
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
