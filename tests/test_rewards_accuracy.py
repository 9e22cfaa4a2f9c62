"""Answer checking: normalised exact match, numbers by value, multiple-choice letters, tags."""

from __future__ import annotations

import pytest

from lightning_vlm.rewards.accuracy import answers_match, normalize


@pytest.mark.parametrize(
    ("completion", "solution", "expected"),
    [
        ("red", "red", True),
        (" Red. ", "red", True),
        ("The red", "red", True),
        ("blue", "red", False),
        ("reddish", "red", False),
        ("<think>hmm</think><answer>3.0</answer>", "3", True),
        ("1,000", "1000", True),
        ("2.5", "2.50", True),
        ("2.4", "2.5", False),
        ("(B)", "b", True),
        ("C.", "B", False),
        ("", "red", False),
        # numbers inside text keep their sign, decimals and fractions (punctuation elsewhere goes)
        ("2.5 hours", "25 hours", False),
        ("x = -3", "x = 3", False),
        ("-3 degrees", "3 degrees", False),
        ("$3.50", "$350", False),
        ("1/2", "12", False),
        ("<answer>-5.</answer>", "5", False),
        ("5.", "5", True),
        ("$3.50", "$3.5", True),
        ("1/2 cup", "0.5 cup", True),
        ("1,000 km", "1000 km", True),
        ("\u22127", "-7", True),  # the Unicode minus sign
        ("\u22127 degrees", "7 degrees", False),
    ],
)
def test_answers_match(completion, solution, expected):
    assert answers_match(completion, solution) is expected


def test_normalize_strips_accents_punctuation_articles():
    assert normalize("  The  Café, a place! ") == "cafe place"
