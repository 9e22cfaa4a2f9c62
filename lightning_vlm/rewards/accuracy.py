"""Answer checking against a reference: normalised exact match, numbers, multiple choice."""

from __future__ import annotations

import math
import re
import string
import struct
import unicodedata
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_CHOICE = re.compile(r"^\(?([A-Za-z])[\).:]?$")
_PUNCT = str.maketrans("", "", string.punctuation)
# Comma thousands only where they can be one: groups of exactly three after a first group that does
# not start with 0, and not inside a comma list ("[112,0,224,112]" holds 224 and 112, not 224112).
THOUSANDS = r"(?<!\d,)[1-9]\d{0,2}(?:,\d{3})+(?!\d|,\d)"
_UNSIGNED = rf"(?:{THOUSANDS}(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
# A number: sign (U+2212 too), comma thousands, decimals, exponent, an optional "/ denominator". Not
# right after a letter, "^" or "_": a unit's exponent or a name ("m2", "cm^2", "H2O") is no number; nor
# the rest of one (".5" of "Qwen2.5", ".2" of "v1.2.3": a digit or "." then a digit is inside a name).
NUMBER = re.compile(
    rf"(?<![A-Za-z0-9^_])(?<![A-Za-z0-9.]\.)([-+\u2212]?{_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?"
)


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# LaTeX forms of a number (R1-style math answers): \frac{1}{2} (\dfrac, \tfrac) and 1.5 \times 10^{3}.
# Whitespace is matched possessively (\s*+): plain "\s*([^{}]*?)\s*" or "\s*\{?\s*" split a run of spaces
# every way at each try, and 2000 spaces after "\frac{" took seconds to read (4000: 47 s), long enough to
# stall a DDP rank into the collective timeout. A fraction's parts are stripped by _frac_value instead.
_FRAC = re.compile(r"\\[dt]?frac\s*+\{([^{}]*+)\}\s*+\{([^{}]*+)\}")
# A whole exponent only ("4^0.5" is no power read here), after a base that is not a name's or a list's.
_POWER = re.compile(
    r"(?<![A-Za-z0-9^_.,])(\d+(?:\.\d+)?)\s*+\^\s*+(\{)?\s*+([-+\u2212]?\d+)(?![\d.])(?(2)\s*+\})"
)
_TIMES_TEN = re.compile(
    r"(\d)\s*+(?:\\times|\\cdot|\u00d7|x|\*)\s*+10\s*+\^\s*+\{?\s*+([-+\u2212]?\d+)\s*+\}?"
)


def _last_boxed(text: str) -> str | None:
    """The content of the last closed ``\\boxed{...}`` (braces nested), or None."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    depth, start = 1, starts[-1].end()
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None  # never closed: a truncated answer names nothing boxed


def extract_answer(text: str) -> str:
    """The final answer of a completion: the last <answer>...</answer> if present, else what follows the
    last ``</think>`` (a thinking model's reasoning holds drafts), else the text; within it, the last
    ``\\boxed{...}`` if there is one (the math convention, R1 and Qwen-Math style)."""
    tagged = _ANSWER_TAG.findall(text)
    answer = tagged[-1] if tagged else text.rpartition("</think>")[2]
    boxed = _last_boxed(answer)
    return answer if boxed is None else boxed


def latex_numbers(text: str) -> str:
    """``text`` with LaTeX numbers written plainly: "\\frac{1}{2}" as "1/2", "1.5 \\times 10^{3}" (or
    "1.5 x 10^3") as "1.5e3", a power of a number ("10^3", "2^{10}") as its value, so that :data:`NUMBER`
    reads them by value. A unit's exponent ("cm^2") is no power: its base is a letter."""
    text = _FRAC.sub(_frac_value, text)
    text = _TIMES_TEN.sub(lambda m: f"{m.group(1)}e{m.group(2).replace(chr(0x2212), '-')}", text)
    return _POWER.sub(_power_value, text)


def _frac_value(match: re.Match) -> str:
    return f"{match.group(1).strip()}/{match.group(2).strip()}"  # "\\frac{ 1 }{ 2 }" is 1/2


def _power_value(match: re.Match) -> str:
    base, exponent = match.group(1), int(match.group(3).replace(chr(0x2212), "-"))
    if abs(exponent) > 400:  # 10^400 or 10^-400: no float holds it; left as written
        return match.group(0)
    if len(base) * max(exponent, 1) > 4000:  # past Python's int-to-text limit (4300 digits); no float either
        return match.group(0)
    if base.isdigit() and exponent >= 0:
        return str(int(base) ** exponent)  # exact: 2^60 is 1152921504606846976
    try:
        return repr(float(base) ** exponent)
    except (OverflowError, ZeroDivisionError):  # 9.9^400, 0^-1: no number
        return match.group(0)


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
    text = latex_numbers(text)
    parts, last = [], 0
    for match in NUMBER.finditer(text):
        value = number_value(match)
        if value is None:  # a fraction over zero stays text
            continue
        parts += [_plain(text[last : match.start()]), f" {value:.15g} "]
        last = match.end()
    parts.append(_plain(text[last:]))
    words = "".join(parts).split()
    # Articles go, unless nothing else is left: the answer "A" (an option) must not become "" and so
    # equal an empty answer.
    return " ".join([w for w in words if w not in ("a", "an", "the")] or words)


def _as_number(text: str) -> float | None:
    match = NUMBER.fullmatch(latex_numbers(text).strip())
    return number_value(match) if match else None


def _float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest, ties to even), as a float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: no float32 value
        return math.nan


def float32_match(value: float, stored: Any) -> bool:
    """Whether ``stored`` is a float32 column's value (a parquet column's 0.10000000149011612 for 0.1) and
    ``value``, rounded to float32, is it: the decimal written, up to the column's rounding. A solution
    written as text is taken as written, and an integer needs no rounding."""
    return (
        isinstance(stored, float)
        and not stored.is_integer()
        and _float32(stored) == stored == _float32(value)
    )


def is_answer_list(solution: Any) -> bool:
    """Whether ``solution`` is a list of accepted answers (VQA's "answers" column): any one is right."""
    return isinstance(solution, list | tuple) and all(isinstance(s, str) for s in solution)


def answers_match(completion: str, solution: Any) -> bool:
    """True when the completion's answer equals the solution (numbers by value, letters as choices).

    A list of strings is a list of accepted answers (VQA's "answers" column): any one matches. Any other
    solution is compared as its text: a list of numbers is a box here (``[0.1, 0.2, 0.5, 0.6]``), whose
    "0.5" must not match; count_reward and numeric_reward, which never take boxes, read it as answers.
    """
    if is_answer_list(solution):  # an empty list matches nothing
        return any(answers_match(completion, s) for s in solution)
    answer = extract_answer(completion).strip()
    stored = solution  # a float column's value, before it becomes text
    solution = solution if isinstance(solution, str) else str(solution)
    solution = extract_answer(solution).strip()
    plain = normalize(answer)
    if not plain:  # nothing (or only punctuation) answers nothing
        return False
    a_num, s_num = _as_number(answer), _as_number(solution)
    if a_num is not None and s_num is not None:
        if a_num.is_integer() and s_num.is_integer():  # counts, years, prices: 1000001 is not 1000000
            return a_num == s_num
        # Decimals: equal up to float rounding only, relative at every scale (1e-7 is not 9e-7, 999999.5
        # not 1e6; a tolerance is numeric_reward's), or to a float32 column's rounding.
        return float32_match(a_num, stored) or math.isclose(a_num, s_num, rel_tol=1e-9)
    a_choice, s_choice = _CHOICE.match(answer), _CHOICE.match(solution)
    if a_choice and s_choice:
        return a_choice.group(1).upper() == s_choice.group(1).upper()
    return plain == normalize(solution)
