"""A sequence-classification reward model used as a reward function (TRL's ``reward_funcs="org/rm"``).

Standard reward models (Skywork-Reward, ArmoRM, ...) are text-only, so images are dropped: the
prompt's image blocks are removed and its text blocks joined before the tokenizer's chat template
renders prompt + completion. The score is the model's single logit at the last non-pad token, the
same pooling its ``forward`` applies, so scores equal an unbatched forward of the same text.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from jinja2 import TemplateError

from lightning_vlm.models.model_source import check_model_source
from lightning_vlm.rewards.builtin import completion_text, content_text

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _text_only(message: Mapping[str, Any]) -> dict[str, Any]:
    return {**message, "content": content_text(message.get("content"))}


class RewardModel:
    """Scores prompt + completion with an ``AutoModelForSequenceClassification`` (``num_labels=1``)."""

    def __init__(
        self,
        model_name_or_path: str | os.PathLike,
        dtype: str | torch.dtype = "float32",
        max_length: int | None = None,
        batch_size: int = 8,
        device: str | torch.device | None = None,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(dtype, str) and dtype not in _DTYPES:
            raise ValueError(f"RewardModel: unknown dtype {dtype!r}; expected one of {tuple(_DTYPES)}")
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(
                f"RewardModel: need batch_size >= 1 and max_length >= 1; got {batch_size}, {max_length}"
            )
        self.model_name_or_path = str(model_name_or_path)
        # A missing folder, or a hub id not cached while offline, named before transformers' generic errors.
        check_model_source(self.model_name_or_path, "RewardModel model_name_or_path")
        self.max_length = max_length
        self.batch_size = batch_size
        # Scorers log rewards under this name, like TRL's `config._name_or_path.split("/")[-1]`.
        self.__name__ = os.path.basename(self.model_name_or_path.rstrip("/\\")) or "reward_model"
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_name_or_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.model_name_or_path, dtype=_DTYPES[dtype] if isinstance(dtype, str) else dtype
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"RewardModel: {self.model_name_or_path} has num_labels={self.model.config.num_labels}; "
                "a reward model outputs one score (num_labels=1)"
            )
        self.model.eval().requires_grad_(False)
        self.pad_token_id = self._pad_token_id()
        if device is not None:
            self.to(device)

    def _pad_token_id(self) -> int:
        # The model pools the last token that is not its pad id, so batches must be padded with
        # exactly that id; tokenizers without a pad token (Llama) fall back to eos.
        text_config = self.model.config.get_text_config()
        pad = text_config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"RewardModel: {self.model_name_or_path} defines neither a pad nor an eos token")
        rows = self.model.get_input_embeddings().num_embeddings
        if not 0 <= pad < rows:
            # Some tokenizer classes add a default pad token the checkpoint's embeddings lack.
            raise ValueError(
                f"RewardModel: pad token id {pad} of {self.model_name_or_path} is outside its {rows} embeddings; "
                "set pad_token_id in the model's config"
            )
        text_config.pad_token_id = pad
        return int(pad)

    def to(self, device: str | torch.device) -> RewardModel:
        """Move the model to ``device`` (e.g. the policy's device); returns self."""
        self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """The device the model is on."""
        return next(self.model.parameters()).device

    def format(self, prompt: Any, completion: Any) -> tuple[str, bool]:
        """The text scored for one sample and whether the tokenizer's special tokens must be added."""
        if isinstance(prompt, str):
            # TRL's standard (non-conversational) format: plain concatenation; the tokenizer adds
            # its own special tokens (e.g. a BOS) as it does for any plain text.
            return prompt + completion_text(completion), True
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"RewardModel: {self.model_name_or_path} has no chat template, needed for conversational prompts"
            )
        if isinstance(completion, str):
            reply = [{"role": "assistant", "content": completion}]
        else:
            reply = [_text_only(m) for m in completion]
        messages = [_text_only(m) for m in prompt] + reply
        # The template already wrote the special tokens; adding them again would double the BOS.
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False), False
        except TemplateError as err:  # e.g. Gemma 2 reward models' templates refuse a system turn
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ValueError(
                f"RewardModel {self.model_name_or_path}: its chat template refused a sample's turns ({roles}): "
                f"{err}"
            ) from err

    def tokenize(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[list[int]]:
        """Token ids of every prompt + completion, left-truncated to ``max_length``."""
        ids = []
        for prompt, completion in zip(prompts, completions, strict=True):
            text, special = self.format(prompt, completion)
            row = self.tokenizer(text, add_special_tokens=special)["input_ids"]
            if self.max_length is not None and len(row) > self.max_length:
                # Keep the end: the score is read at the last token, which must see the completion.
                log.warning(
                    "RewardModel: a sample of %d tokens was cut to its last %d", len(row), self.max_length
                )
                row = row[-self.max_length :]
            ids.append(list(row))
        return ids

    @torch.inference_mode()
    def score_ids(self, ids: Sequence[Sequence[int]]) -> list[float]:
        """Scores of already tokenised samples, batched by similar length and right-padded."""
        if any(len(row) == 0 for row in ids):
            raise ValueError("RewardModel: a sample tokenised to nothing; there is no last token to score")
        scores: list[float] = [0.0] * len(ids)
        # Sorting by length keeps padding (wasted compute) small; scores do not depend on it.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        device = self.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                # Right padding whatever the tokenizer's padding_side: positions then start at 0
                # for every row, as in an unpadded forward.
                input_ids[row, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
                attention_mask[row, : len(ids[i])] = 1
            logits = self.model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
            ).logits
            for row, i in enumerate(batch):
                scores[i] = float(logits[row, 0].float())
        return scores

    def __call__(
        self, completions: Sequence[Any], prompts: Sequence[Any] | None = None, **kwargs: Any
    ) -> list[float]:
        """One score per completion, from the reward model reading its prompt and the completion."""
        if prompts is None:
            raise ValueError("RewardModel needs the `prompts` column to score completions in context")
        return self.score_ids(self.tokenize(prompts, completions))

    def __repr__(self) -> str:
        return f"RewardModel({self.model_name_or_path!r}, max_length={self.max_length}, batch_size={self.batch_size})"
