"""How many tokens validation generates for its held-out answers: set, or following the data.

``val_max_new_tokens: null`` means the longest reference answer of the validation set, in tokens of the
model's tokenizer, plus ``ANSWER_MARGIN``: the end-of-turn token, and a word tokenised differently after
the chat template than alone. A fixed cap either cuts long answers (DPO's old 4 cut "The shapes are red.")
or, when large, spends every validation batch generating past short ones that never stop. Computed once
at the first validation of a run from every validation row (the same value on every rank), and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger(__name__)

ANSWER_MARGIN = 4


@runtime_checkable
class ValidationRows(Protocol):
    """A DataModule that can list its validation rows, normalised, images undecoded (``VLMDataModule``)."""

    def val_rows(self) -> list[dict]: ...


class TextTokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> dict: ...


def answer_token_budget(answers: list[str], tokenizer: TextTokenizer, margin: int = ANSWER_MARGIN) -> int:
    """Tokens of the longest answer plus ``margin`` (just ``margin`` without answers)."""
    if not answers:
        return margin
    ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
    return max(len(i) for i in ids) + margin


def check_setting(setting: int | None) -> None:
    """A set ``val_max_new_tokens`` must be positive (checked when the method is built)."""
    if setting is not None and setting < 1:
        raise ValueError(f"method.val_max_new_tokens must be >= 1 or null, got {setting}")


def resolve_val_max_new_tokens(
    setting: int | None,
    datamodule: object,
    references: Callable[[list[dict]], list[str]],
    tokenizer: TextTokenizer,
) -> int:
    """``setting`` when given, else the budget of the reference answers of ``datamodule``'s validation
    rows (``references`` extracts them from the rows, as the method's validation step does)."""
    if setting is not None:
        return setting
    if not isinstance(datamodule, ValidationRows):
        raise TypeError(
            "method.val_max_new_tokens=null sizes validation answers from the DataModule's val_rows(), but "
            f"the trainer has {type(datamodule).__name__}; set method.val_max_new_tokens to a number"
        )
    rows = datamodule.val_rows()
    budget = answer_token_budget(references(rows), tokenizer)
    if rank_zero_only.rank == 0:  # every rank computes the same value; one report is enough
        log.info(
            "val_max_new_tokens=%d: the longest of %d validation answers + %d tokens "
            "(method.val_max_new_tokens=null; set a number to override)",
            budget, len(rows), ANSWER_MARGIN,
        )  # fmt: skip
    return budget
