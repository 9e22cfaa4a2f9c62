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
    ],
)
def test_answers_match(completion, solution, expected):
    assert answers_match(completion, solution) is expected


def test_normalize_strips_accents_punctuation_articles():
    assert normalize("  The  Café, a place! ") == "cafe place"
