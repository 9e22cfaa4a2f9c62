"""The OCR answer reward: character-level similarity (one minus normalised edit distance) to the reference text.

Follows the answer-reward convention of ``answers.py`` (``score_with_reference``).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_vlm.rewards.accuracy import extract_answer
from lightning_vlm.rewards.answers import score_with_reference

if TYPE_CHECKING:
    from lightning_vlm.rewards.builtin import Completion


def levenshtein(a: str, b: str) -> int:
    """The edit distance between two strings: fewest single-character insertions, deletions, substitutions.

    The dynamic programme row by row, each row as array operations (a runaway completion of 10k
    characters against a page of reference text is 10k row steps, not 10^8 Python steps that stall a
    reward call for minutes). Within a row, insertions chain left to right: ``row[j] = min(best[j],
    row[j-1] + 1)`` is ``j + min over k <= j of (best[k] - k)``, a running minimum.
    """
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    codes = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)  # one code point per character
    columns = np.arange(len(b) + 1)
    previous = columns.copy()
    best = np.empty_like(previous)
    for i, char in enumerate(a, start=1):
        best[0] = i
        # substitution (or a match) from the diagonal, deletion from above
        np.minimum(previous[:-1] + (codes != ord(char)), previous[1:] + 1, out=best[1:])
        previous = np.minimum.accumulate(best - columns) + columns
    return int(previous[-1])


def _ocr_text(text: str, normalize: bool) -> str:
    # One text may be encoded two ways ("é" as one code point or "e" + a combining accent); NFC makes
    # them one, in both modes, since they are the same characters. Normalised, NFKC also reads the
    # compatibility forms as what they show: full-width "ＨＥＬＬＯ" (CJK text) as "HELLO", the ligature
    # "ﬁ" as "fi". Case and spacing are not what an OCR answer is judged on; punctuation is, so it stays.
    if not normalize:
        return unicodedata.normalize("NFC", text)
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def ocr_similarity(prediction: str, reference: str, normalize: bool = True) -> float:
    """``1 - levenshtein / max(len)`` between the two texts, in [0, 1]; 1.0 when both are empty.

    Both texts are put in Unicode's composed form (NFC) first; ``normalize`` reads compatibility forms as
    what they show (NFKC: full-width letters, ligatures), case-folds and collapses whitespace
    (stripping the ends).
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
