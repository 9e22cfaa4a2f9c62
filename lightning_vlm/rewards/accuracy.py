"""Answer checking against a reference: normalised exact match, numbers, multiple choice."""

from __future__ import annotations

import re
import string
import unicodedata

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_CHOICE = re.compile(r"^\(?([A-Za-z])[\).:]?$")
_PUNCT = str.maketrans("", "", string.punctuation)
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
# A number: sign (U+2212 too), comma thousands, decimals, exponent, an optional "/ denominator". Not
# right after a letter, "^" or "_": a unit's exponent or a name ("m2", "cm^2", "H2O") is no number.
NUMBER = re.compile(rf"(?<![A-Za-z^_])([-+\u2212]?{_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?")


def extract_answer(text: str) -> str:
    """The final answer of a completion: the last <answer>...</answer> if present, else the text."""
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1] if tagged else text


def number_value(match: re.Match) -> float | None:
    """The value of a :data:`NUMBER` match; None for a fraction over zero."""
    numerator, denominator = (g.replace(",", "").replace("\u2212", "-") if g else g for g in match.groups())
    value = float(numerator)
    if denominator is None:
        return value
    den = float(denominator)
    return value / den if den != 0 else None


def _plain(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return text.lower().translate(_PUNCT)


def normalize(text: str) -> str:
    """Lower-case, strip accents, punctuation, articles and extra whitespace; numbers are kept by value.

    Punctuation inside a number is part of it: "2.5" must not become "25", nor "-3" become "3". So each
    number is written as its value ("3.50" and "7/2" as 3.5, "1,000" as 1000) and only the text
    between numbers loses its punctuation.
    """
    parts, last = [], 0
    for match in NUMBER.finditer(text):
        value = number_value(match)
        if value is None:  # a fraction over zero stays text
            continue
        parts += [_plain(text[last : match.start()]), f" {value:.15g} "]
        last = match.end()
    parts.append(_plain(text[last:]))
    words = [w for w in "".join(parts).split() if w not in ("a", "an", "the")]
    return " ".join(words)


def _as_number(text: str) -> float | None:
    match = NUMBER.fullmatch(text.strip())
    return number_value(match) if match else None


def answers_match(completion: str, solution: str) -> bool:
    """True when the completion's answer equals the solution (numbers by value, letters as choices)."""
    answer = extract_answer(completion).strip()
    solution = extract_answer(solution).strip()
    a_num, s_num = _as_number(answer), _as_number(solution)
    if a_num is not None and s_num is not None:
        return abs(a_num - s_num) <= 1e-6 * max(1.0, abs(s_num))
    a_choice, s_choice = _CHOICE.match(answer), _CHOICE.match(solution)
    if a_choice and s_choice:
        return a_choice.group(1).upper() == s_choice.group(1).upper()
    return normalize(answer) == normalize(solution)
