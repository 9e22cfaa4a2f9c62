"""The settings every online method shares, as keyword arguments typed once.

GRPO, RLOO and Online DPO take ``**online: Unpack[OnlineKwargs]`` and pass them on to
:class:`~lightning_vlm.methods.online.OnlineRL`, whose signature holds each default once; their own
signatures list only what is theirs (and the defaults they change, such as Online DPO's two
generations). Type checkers and IDEs see every key through this TypedDict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from lightning_vlm.generation.base import SamplingOptions
from lightning_vlm.methods.dynamic_sampling import DynamicSampling


class OnlineKwargs(TypedDict, total=False):
    """Keyword arguments of :class:`~lightning_vlm.methods.online.OnlineRL` (see it for defaults)."""

    scheduler: Callable[..., Any] | None
    reward_funcs: Sequence[Any]
    reward_weights: Sequence[float] | None
    reward_model: Any | None
    num_generations: int
    num_iterations: int
    steps_per_generation: int
    micro_batch_size: int | None
    max_completion_length: int
    sampling: SamplingOptions | Mapping[str, Any] | None
    beta: float
    mask_truncated_completions: bool
    max_grad_norm: float | None
    vllm_importance_sampling_correction: bool
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_max: float | None
    vllm_importance_sampling_clip_min: float | None
    val_num_generations: int
    val_seed: int
    seed: int | None
    dynamic_sampling: DynamicSampling | Mapping[str, Any] | None
    disable_dropout: bool
