"""Answer checking against a reference: normalised exact match, numbers, multiple choice."""

from __future__ import annotations

import re
import string
import unicodedata

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:[eE][-+]?\d+)?")
_CHOICE = re.compile(r"^\(?([A-Za-z])[\).:]?$")
_PUNCT = str.maketrans("", "", string.punctuation)


def extract_answer(text: str) -> str:
    """The final answer of a completion: the last <answer>...</answer> if present, else the text."""
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1] if tagged else text


def normalize(text: str) -> str:
    """Lower-case, strip accents, punctuation, articles and extra whitespace."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = text.lower().translate(_PUNCT)
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def _as_number(text: str) -> float | None:
    match = _NUMBER.fullmatch(text.strip().replace(",", ""))
    return float(match.group()) if match else None


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
