"""Answer rewards for visual question answering: counts and numbers, and the loop every answer reward shares.

Multiple-choice letters are in ``choices.py``, OCR text in ``ocr.py``. Each reward follows the built-in convention (see ``builtin.py``): ``fn(completions, solution=None,
**columns) -> list[float | None]``. The answer is read from the completion's last
``<answer>...</answer>`` block when it has one (``extract_answer``), else from the whole text. A
missing ``solution`` column raises ``ValueError``; a missing cell gives ``None``; a solution that
cannot be read raises ``ValueError`` naming its row; a completion that cannot be read scores 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_vlm.rewards.accuracy import (
    NUMBER,
    THOUSANDS,
    extract_answer,
    float32_match,
    is_answer_list,
    latex_numbers,
    number_value,
)

if TYPE_CHECKING:
    from lightning_vlm.rewards.builtin import Completion

Ref = TypeVar("Ref")

NUMBER_WORDS: dict[str, int] = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
# "none" is how people answer a count of zero ("How many circles? None"). "no" is not read: it is as
# often a reply ("No, there are three") as a count.
COUNT_WORDS: dict[str, int] = {**NUMBER_WORDS, "none": 0}
# A hyphen on either side means a compound ("twenty-one"), outside the words counted.
# A sign is read with its digits: "-3" is a count of -3, no count of 3; "3-4" names 3 and 4 (a hedge).
_COUNT = re.compile(
    rf"(?<![\w.])([-\u2212]?(?:{THOUSANDS}|\d+)(?:\.\d+)?)(?!\w)|(?<![\w-])("
    + "|".join(COUNT_WORDS)
    + r")(?![\w-])",
    re.I,
)


# What the trainer passes besides the data's columns (online_sampling.score).
TRAINER_COLUMNS = ("completion_ids", "trainer_state", "generation_prompt")


def missing_solution(name: str, columns: Mapping[str, Any]) -> ValueError:
    """The error for a reward run without a ``solution`` column: a configuration mistake (the data names its
    references otherwise: ``answer``, ``ground_truth``), not rows without references, so every score would
    be None. Names the data's columns and the setting that maps one."""
    data = sorted(k for k in columns if k not in TRAINER_COLUMNS)
    return ValueError(
        f"{name} needs a `solution` column (one reference per completion); the columns given were {data}. "
        "If the data names its references otherwise, map that column: data.column_map={<column>: solution}"
    )


def score_with_reference(
    name: str,
    completions: Sequence[Completion],
    solution: Sequence[Any] | None,
    columns: dict[str, Any],
    read_reference: Callable[[Any], Ref],
    score: Callable[[str, Ref], float],
    lists: bool = True,
) -> list[float | None]:
    """The loop every reference-based reward shares: checks the column, skips missing cells, reads each solution.

    A solution that is a list of strings or numbers is a list of accepted answers (``answers_match`` takes
    strings only, since its list of numbers may be a box): the reward is the best score over them (blank
    ones skipped; all blank is a missing cell). ``lists=False``
    for a reward whose one reference may be a list (a box as four numbers).

    ``read_reference`` raises ``ValueError`` for a solution it cannot read; the error is re-raised
    with the reward's name and the row index, since a bad reference is a dataset problem to fix.
    """
    # Imported here, not at the top: builtin.py imports this module to register its rewards, and a
    # top-level import back would fail whenever this module is the one loaded first.
    from lightning_vlm.rewards.builtin import _missing, completion_text

    if solution is None:
        raise missing_solution(name, columns)
    rewards: list[float | None] = []
    for row, (completion, reference) in enumerate(zip(completions, solution, strict=True)):
        accepted = (
            [r for r in reference if not _missing(r)]
            if lists and (is_answer_list(reference) or _is_number_list(reference))
            else [reference]
        )
        if not accepted or _missing(accepted[0]):
            rewards.append(None)
            continue
        try:
            refs = [read_reference(r) for r in accepted]
        except ValueError as err:
            raise ValueError(f"{name}: row {row}: {err}") from err
        text = completion_text(completion)
        rewards.append(max(score(text, ref) for ref in refs))
    return rewards


def _is_number_list(reference: Any) -> bool:
    """A list of numbers (``[3, 4]``): accepted answers of a count or number, as a list of strings is."""
    return isinstance(reference, list | tuple) and all(
        isinstance(r, int | float) and not isinstance(r, bool) for r in reference
    )


def parse_counts(text: str) -> list[float]:
    """Every count the answer names, in order: digits ("3", "3.0"), number words zero..twenty, or "none" (0)."""
    return [
        float(digits.replace(",", "").replace("\u2212", "-"))
        if digits is not None
        else float(COUNT_WORDS[word.lower()])
        for digits, word in (m.groups() for m in _COUNT.finditer(extract_answer(text)))
    ]


def parse_count(text: str) -> float | None:
    """The first count in the answer: digits ("3", "3.0"), a number word zero..twenty or "none" (0); None
    if there is none."""
    counts = parse_counts(text)
    return counts[0] if counts else None


def _reference_number(reference: Any, parse: Callable[[str], float | None], expected: str) -> float:
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        return float(reference)
    value = parse(str(reference))
    if value is None:
        raise ValueError(f"cannot read {expected} from the solution {reference!r}")
    return value


def count_reward(
    completions: Sequence[Completion], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer names the solution's count (digits, zero..twenty or "none",
    see ``parse_counts``) and no other, else 0.0.

    "There are 3 shapes: three" names one count; "two or three" names two and scores 0.0, as hedging
    does in ``multiple_choice_reward``: a reward for the first count alone pays a policy to list counts
    (measured: a tiny model's GRPO drifted to "two four four ..." and never ended its answers). Keep
    reasoning that mentions other numbers outside the ``<answer>`` tags, which are read when present.
    """

    def score(text: str, ref: float) -> float:
        counts = set(parse_counts(text))
        return 1.0 if counts == {ref} else 0.0

    return score_with_reference(
        "count_reward",
        completions,
        solution,
        kwargs,
        lambda ref: _reference_number(ref, parse_count, 'a count (digits, zero..twenty or "none")'),
        score,
    )


def parse_numbers(text: str) -> list[float | None]:
    """Every number the answer names, in order (``parse_number``'s forms; None for a fraction over zero)."""
    return [number_value(m) for m in NUMBER.finditer(latex_numbers(extract_answer(text)))]


def parse_number(text: str) -> float | None:
    """The first number in the answer, or None.

    Accepted: an optional sign, digits with optional decimals (".5", "2.50"), comma thousands
    separators in groups of three ("1,234.5"; not inside a comma list: "[112,0,224,112]" is four
    numbers), an exponent ("1e-3") and fractions ("3/4", "-1/2"; a zero denominator reads as no
    number), with "-" or the Unicode minus "−". A percent sign is ignored: "50%" is 50, so write
    percentages the same way in the solution. Spaces as thousands
    separators are not. Digits right after a letter or "^" belong to a word or unit ("m2", "cm^2",
    "H2O"): "12 cm^2" names one number, 12.
    """
    numbers = parse_numbers(text)
    return numbers[0] if numbers else None


def numeric_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    rel_tol: float = 0.0,
    abs_tol: float = 0.0,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the answer names a number (``parse_numbers``) and every number it names is within
    ``max(rel_tol * |solution|, abs_tol)`` of the solution, else 0.0.

    The relative tolerance is of the solution, as ChartQA's relaxed accuracy (``math.isclose`` measures
    it against the larger value, which gives overestimates more room). With both tolerances at 0 (the
    default) the values must be equal; ``abs_tol`` matters for solutions near zero, where a relative
    tolerance accepts almost nothing. "48 or 60" scores 0.0
    unless both are within the tolerance: hedging is not rewarded (see ``count_reward``; measured, a
    tiny model's GRPO on the first number alone drifted into lists of numbers). Keep reasoning that
    mentions other numbers outside the ``<answer>`` tags, which are read when present.
    """
    if rel_tol < 0 or abs_tol < 0:
        raise ValueError(f"numeric_reward: tolerances must be >= 0; got rel_tol={rel_tol}, abs_tol={abs_tol}")

    def score(text: str, ref: tuple[float, Any]) -> float:
        value, stored = ref
        values = parse_numbers(text)
        ok = bool(values) and all(
            v is not None
            and (abs(v - value) <= max(rel_tol * abs(value), abs_tol) or float32_match(v, stored))
            for v in values
        )
        return 1.0 if ok else 0.0

    return score_with_reference(
        "numeric_reward",
        completions,
        solution,
        kwargs,
        # The solution as stored is kept: a float32 column's 0.10000000149011612 is the answer 0.1, as in
        # answers_match, and only the stored float (not its text) says so.
        lambda ref: (_reference_number(ref, parse_number, "a number"), ref),
        score,
    )
