"""The OCR answer reward: edit distance against hand values and the textbook programme, similarity and reward."""

from __future__ import annotations

import math
import random

import pytest

from lightning_vlm.rewards.ocr import levenshtein, ocr_reward, ocr_similarity


def test_levenshtein_hand_values():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("sitting", "kitten") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_levenshtein_equals_the_textbook_programme():
    def textbook(a: str, b: str) -> int:
        d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
        return d[-1][-1]

    rng = random.Random(0)
    for _ in range(300):
        a, b = ("".join(rng.choices("ab\u00e9\U0001f600 ", k=rng.randint(0, 25))) for _ in range(2))
        assert levenshtein(a, b) == textbook(a, b), (a, b)
    assert levenshtein("a" * 3000, "b" * 2000) == 3000


def test_ocr_similarity_and_reward():
    assert ocr_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert ocr_similarity("", "") == 1.0
    assert ocr_similarity("", "abc") == 0.0
    assert ocr_similarity("  Hello   World ", "hello world") == 1.0
    assert ocr_similarity("Hello", "hello", normalize=False) == pytest.approx(0.8)
    rewards = ocr_reward(["<answer>STOP</answer>", "kitten", "x"], ["stop", "sitting", None])
    assert rewards[0] == 1.0 and rewards[1] == pytest.approx(1 - 3 / 7) and rewards[2] is None
    assert math.isclose(ocr_reward(["Stop."], ["stop"], normalize=False)[0], 1 - 2 / 5)
    # one text, two encodings (composed and decomposed accents): the same text, normalised or not
    for normalize in (True, False):
        assert ocr_reward(["caf\u00e9"], ["cafe\u0301"], normalize=normalize) == [1.0]
    with pytest.raises(ValueError, match="ocr_reward needs a `solution` column"):
        ocr_reward(["x"])
