"""Answer rewards for visual question answering: counts, numbers, multiple-choice letters, OCR text.

Each reward follows the built-in convention (see ``builtin.py``): ``fn(completions, solution=None,
**columns) -> list[float | None]``. The answer is read from the completion's last
``<answer>...</answer>`` block when it has one (``extract_answer``), else from the whole text. A
missing ``solution`` column raises ``ValueError``; a missing cell gives ``None``; a solution that
cannot be read raises ``ValueError`` naming its row; a completion that cannot be read scores 0.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lightning_vlm.rewards.accuracy import extract_answer

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
# A hyphen on either side means a compound ("twenty-one"), outside the words counted.
_COUNT = re.compile(
    r"(?<![\w.])(\d+(?:\.\d+)?)(?!\w)|(?<![\w-])(" + "|".join(NUMBER_WORDS) + r")(?![\w-])", re.I
)
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"([-+]?{_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?")
_WHOLE_CHOICE = re.compile(r"\s*[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?\s*")
_PAREN_CHOICE = re.compile(r"[(\[]\s*([A-Za-z])\s*[)\]]")
_CUE_CHOICE = re.compile(r"\b(?:answer|option|choice)(?:\s+is)?\s*[:=]?\s*[(\[]?\s*([A-Za-z])(?![\w'])", re.I)
_UPPER_CHOICE = re.compile(r"(?<![\w'])([A-Z])(?![\w'])")
_ARTICLE_NEXT = re.compile(r"\s+([a-z]+)")
# Words after a letter that make it an option, not the article: "A is correct", "I think A fits".
_OPTION_VERBS = frozenset(
    {"is", "was", "seems", "looks", "fits", "matches", "would", "should", "must", "can"}
)


def score_with_reference(
    name: str,
    completions: Sequence[Completion],
    solution: Sequence[Any] | None,
    columns: dict[str, Any],
    read_reference: Callable[[Any], Ref],
    score: Callable[[str, Ref], float],
) -> list[float | None]:
    """The loop every reference-based reward shares: checks the column, skips missing cells, reads each solution.

    ``read_reference`` raises ``ValueError`` for a solution it cannot read; the error is re-raised
    with the reward's name and the row index, since a bad reference is a dataset problem to fix.
    """
    # Imported here, not at the top: builtin.py imports this module to register its rewards, and a
    # top-level import back would fail whenever this module is the one loaded first.
    from lightning_vlm.rewards.builtin import _missing, completion_text

    if solution is None:
        # A missing column is a configuration mistake, not rows without references.
        raise ValueError(
            f"{name} needs a `solution` column (one reference per completion); "
            f"the columns given were {sorted(columns)}"
        )
    rewards: list[float | None] = []
    for row, (completion, reference) in enumerate(zip(completions, solution, strict=True)):
        if _missing(reference):
            rewards.append(None)
            continue
        try:
            ref = read_reference(reference)
        except ValueError as err:
            raise ValueError(f"{name}: row {row}: {err}") from err
        rewards.append(score(completion_text(completion), ref))
    return rewards


def parse_counts(text: str) -> list[float]:
    """Every count the answer names, in order: digits ("3", "3.0") or number words zero..twenty."""
    return [
        float(digits) if digits is not None else float(NUMBER_WORDS[word.lower()])
        for digits, word in (m.groups() for m in _COUNT.finditer(extract_answer(text)))
    ]


def parse_count(text: str) -> float | None:
    """The first count in the answer: digits ("3", "3.0") or a number word zero..twenty; None if there is none."""
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
    """1.0 when the completion's answer names the solution's count (digits or zero..twenty, see
    ``parse_counts``) and no other, else 0.0.

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
        lambda ref: _reference_number(ref, parse_count, "a count (digits or zero..twenty)"),
        score,
    )


def _number(match: re.Match) -> float | None:
    numerator, denominator = (g.replace(",", "") if g else g for g in match.groups())
    value = float(numerator)
    if denominator is None:
        return value
    den = float(denominator)
    return value / den if den != 0 else None


def parse_numbers(text: str) -> list[float | None]:
    """Every number the answer names, in order (``parse_number``'s forms; None for a fraction over zero)."""
    return [_number(m) for m in _NUMBER.finditer(extract_answer(text))]


def parse_number(text: str) -> float | None:
    """The first number in the answer, or None.

    Accepted: an optional sign, digits with optional decimals (".5", "2.50"), comma thousands
    separators in groups of three ("1,234.5"), an exponent ("1e-3") and fractions ("3/4",
    "-1/2"; a zero denominator reads as no number). A percent sign is ignored: "50%" is 50, so
    write percentages the same way in the solution. Spaces as thousands separators are not.
    """
    match = _NUMBER.search(extract_answer(text))
    return None if match is None else _number(match)


def numeric_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    rel_tol: float = 0.0,
    abs_tol: float = 0.0,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the answer names a number (``parse_numbers``) and every number it names is
    ``math.isclose`` to the solution, else 0.0.

    With both tolerances at 0 (the default) the values must be equal; ``abs_tol`` matters for
    solutions near zero, where a relative tolerance accepts almost nothing. "48 or 60" scores 0.0
    unless both are within the tolerance: hedging is not rewarded (see ``count_reward``; measured, a
    tiny model's GRPO on the first number alone drifted into lists of numbers). Keep reasoning that
    mentions other numbers outside the ``<answer>`` tags, which are read when present.
    """
    if rel_tol < 0 or abs_tol < 0:
        raise ValueError(f"numeric_reward: tolerances must be >= 0; got rel_tol={rel_tol}, abs_tol={abs_tol}")

    def score(text: str, ref: float) -> float:
        values = parse_numbers(text)
        ok = bool(values) and all(
            v is not None and math.isclose(v, ref, rel_tol=rel_tol, abs_tol=abs_tol) for v in values
        )
        return 1.0 if ok else 0.0

    return score_with_reference(
        "numeric_reward",
        completions,
        solution,
        kwargs,
        lambda ref: _reference_number(ref, parse_number, "a number"),
        score,
    )


def _is_article(answer: str, letter: str, end: int) -> bool:
    """Whether ``letter`` ("A" or "a") ending at ``end`` reads as the article: a lower-case word follows
    and it is not a verb ("a cat" is the article, "A is right" the option)."""
    follow = _ARTICLE_NEXT.match(answer, end)
    return letter in "Aa" and follow is not None and follow.group(1) not in _OPTION_VERBS


def _choice_mentions(answer: str) -> set[str]:
    mentions = {m.group(1).upper() for m in _PAREN_CHOICE.finditer(answer)}
    for match in _CUE_CHOICE.finditer(answer):
        # "the answer is a cat": a lower-case "a" followed by a word is the article.
        if not (match.group(1) == "a" and _is_article(answer, "a", match.end())):
            mentions.add(match.group(1).upper())
    for match in _UPPER_CHOICE.finditer(answer):
        # Lone capitals are options ("B is right", "B. blue"), except the article opening a sentence.
        if not _is_article(answer, match.group(1), match.end()):
            mentions.add(match.group(1))
    return mentions


def parse_choice(text: str, choices: str = "ABCDEFGH") -> str | None:
    """The option letter the answer names (upper case), or None when it names none or several different ones.

    An answer that is just a letter counts in either case ("b", "(B)", "B."). In longer text a letter
    counts when it is parenthesised ("(b)"), follows "answer", "option" or "choice" ("Answer: B",
    "the answer is b"), or stands alone as a capital ("B. blue", "I pick C"); "A"/"a" followed by
    a lower-case word reads as the article. Letters outside ``choices`` are ignored.
    """
    answer = extract_answer(text)
    whole = _WHOLE_CHOICE.fullmatch(answer)
    if whole is not None:
        mentions = {whole.group(1).upper()}
    else:
        mentions = _choice_mentions(answer)
    mentions &= set(choices.upper())
    return mentions.pop() if len(mentions) == 1 else None


def _check_choices(choices: str) -> str:
    letters = choices.upper()
    if not letters or not letters.isalpha() or not letters.isascii() or len(set(letters)) != len(letters):
        raise ValueError(
            f"multiple_choice_reward: choices must be distinct letters such as 'ABCD'; got {choices!r}"
        )
    return letters


def multiple_choice_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    choices: str = "ABCDEFGH",
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the completion names exactly the solution's option letter (see ``parse_choice``), else 0.0.

    A completion naming several different letters ("B or C", "B, not C") scores 0.0: hedging
    between options must not be rewarded.
    """
    letters = _check_choices(choices)

    def read(ref: Any) -> str:
        letter = parse_choice(str(ref), letters)
        if letter is None:
            raise ValueError(f"cannot read one option letter of {letters!r} from the solution {ref!r}")
        return letter

    return score_with_reference(
        "multiple_choice_reward",
        completions,
        solution,
        kwargs,
        read,
        lambda text, ref: 1.0 if parse_choice(text, letters) == ref else 0.0,
    )


def levenshtein(a: str, b: str) -> int:
    """The edit distance between two strings: fewest single-character insertions, deletions, substitutions."""
    if len(a) < len(b):
        a, b = b, a
    # Two rows of the dynamic programme, as long as the shorter string: previous and current.
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _ocr_text(text: str, normalize: bool) -> str:
    # Case and spacing are not what an OCR answer is judged on; punctuation is, so it stays.
    return " ".join(text.casefold().split()) if normalize else text


def ocr_similarity(prediction: str, reference: str, normalize: bool = True) -> float:
    """``1 - levenshtein / max(len)`` between the two texts, in [0, 1]; 1.0 when both are empty.

    ``normalize`` case-folds and collapses whitespace (also stripping the ends) first.
    """
    prediction, reference = _ocr_text(prediction, normalize), _ocr_text(reference, normalize)
    longest = max(len(prediction), len(reference))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(prediction, reference) / longest


def ocr_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    normalize: bool = True,
    **kwargs: Any,
) -> list[float | None]:
    """Character-level similarity of the completion's answer to the reference text (``ocr_similarity``).

    Partial credit for near misses, unlike exact match. The reference is taken whole (no answer
    tags are looked for in it); an empty reference cell is a missing one (None), as in every reward.
    With ``normalize=False`` the texts are compared exactly, surrounding whitespace included.
    """
    return score_with_reference(
        "ocr_reward",
        completions,
        solution,
        kwargs,
        str,
        lambda text, ref: ocr_similarity(extract_answer(text), ref, normalize),
    )
