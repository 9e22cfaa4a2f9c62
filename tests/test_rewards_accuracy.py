"""Answer checking: normalised exact match, numbers by value, multiple-choice letters, tags."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vlm.rewards.accuracy import answers_match, latex_numbers, normalize
from lightning_vlm.rewards.answers import numeric_reward, parse_numbers
from lightning_vlm.rewards.boxes import parse_box
from lightning_vlm.rewards.choices import parse_choice


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
        # a one-letter option is not an article to drop: it must not equal an empty answer
        ("", "A", False),
        ("<answer></answer>", "A", False),
        ("the", "A", False),
        ("a", "A", True),
        ("B", "A", False),
        # LaTeX: the last \boxed{} is the answer; \frac and powers of ten are numbers
        (r"so \boxed{42}", "42", True),
        (r"<answer>\boxed{\frac{1}{2}}</answer>", "0.5", True),
        (r"\boxed{1} then \boxed{2}", "2", True),
        (r"\boxed{\text{red}}", "red", False),  # \text stays text: not stripped silently
        (r"\dfrac{3}{4}", "3/4", True),
        (r"1.5 \times 10^{3}", "1500", True),
        ("1.5 x 10^3", "1500", True),
        (r"\boxed{4", "4", False),  # an unclosed box: the raw text, not a number
    ],
)
def test_answers_match(completion, solution, expected):
    assert answers_match(completion, solution) is expected


def test_normalize_strips_accents_punctuation_articles():
    assert normalize("  The  Café, a place! ") == "cafe place"


def test_latex_numbers_in_numeric_rewards():
    from lightning_vlm.rewards import numeric_reward
    from lightning_vlm.rewards.answers import parse_number, parse_numbers

    assert parse_number(r"\frac{1}{2}") == 0.5
    assert parse_number(r"-\frac{3}{4}") == -0.75
    assert parse_number(r"\boxed{7}") == 7.0
    assert parse_numbers(r"2.5 \times 10^{-2}") == [0.025]
    assert numeric_reward([r"The area is \boxed{\frac{1}{2}}"], solution=["0.5"]) == [1.0]


@pytest.mark.parametrize("power", ["123456789012^400", "9" * 5000 + "^2", "7^9000"])
def test_a_power_too_long_to_write_out_scores_zero_and_is_left_as_written(power):
    # str(int(base) ** exponent) past 4300 digits raised ValueError (Python's int-to-text limit): the
    # reward raised, and with it the training step.
    from lightning_vlm.rewards import accuracy_reward, numeric_reward
    from lightning_vlm.rewards.accuracy import latex_numbers

    completion = [[{"role": "assistant", "content": f"<answer>{power}</answer>"}]]
    assert accuracy_reward(completion, solution=["3"]) == [0.0]
    assert numeric_reward(completion, solution=["3"]) == [0.0]
    assert latex_numbers(power) == power
    assert latex_numbers("2^60 + 10^{3}") == "1152921504606846976 + 1000"


def test_numbers_inside_names_are_not_read():
    from lightning_vlm.rewards.answers import parse_numbers

    assert parse_numbers("Qwen2.5 counts 3") == [3.0]  # ".5" of the name was read as 0.5
    assert parse_numbers("v1.2.3") == []
    assert parse_numbers("It is .5, or 1,000.5") == [0.5, 1000.5]


def test_integers_are_compared_exactly():
    # A relative tolerance of 1e-6 made 1000001 equal 1000000: wrong for counts, years and prices.
    for answer, solution in (("1000001", "1000000"), ("999999", "1000000"), ("12345679", "12345678")):
        assert not answers_match(answer, solution)
    assert (
        answers_match("1e6", "1000000")
        and answers_match("2.50", "2.5")
        and answers_match("0.30000000000000004", "0.3")
    )
    assert answers_match("2^60", "1152921504606846976")  # a power's value is exact


def test_decimals_are_equal_only_up_to_float_rounding():
    # The tolerance was 1e-6 absolute below 1: 1e-7 equalled 9e-7 (and 0 equalled 5e-7), and 999999.5
    # equalled 1000000.
    for answer, solution in (
        ("0.0000001", "0.0000009"), ("5e-7", "1e-7"), ("0", "0.0000005"), ("999999.5", "1000000"),
        ("1234567.5", "1234568"),
    ):  # fmt: skip
        assert not answers_match(answer, solution), (answer, solution)
    assert answers_match("1.0000000000000002e-7", "1e-7") and answers_match("0.1", "0.10000000000000001")
    # A float32 column's values (to_pylist of a parquet column) are the decimals written, up to its rounding
    assert answers_match("0.1", 0.10000000149011612) and answers_match("0.35", 0.3499999940395355)
    assert not answers_match("0.1", "0.10000000149011612")  # written as text: taken as written
    for answer, solution in (("10000000.5", "10000000"), ("12345678.5", "12345679.5"), ("10000000.5", 1e7)):
        assert not answers_match(answer, solution), (answer, solution)


def test_numeric_reward_takes_a_float32_columns_values_as_the_decimals_written():
    # A float32 column (to_pylist of a parquet column) holds 0.10000000149011612 for 0.1: numeric_reward
    # scored the exact answer 0.0 where accuracy_reward gave 1.0.
    column = [float(np.float32(0.1)), float(np.float32(12.7)), float(np.float32(0.35))]
    assert numeric_reward(["0.1", "12.7", "<answer>0.35</answer>"], column) == [1.0, 1.0, 1.0]
    assert numeric_reward(["0.2", "12.8", "0.1 or 0.2"], [column[0], column[1], column[0]]) == [0.0, 0.0, 0.0]
    assert numeric_reward(["0.1"], [[column[1], column[0]]]) == [1.0]  # a list of accepted answers
    assert numeric_reward(["0.1"], ["0.10000000149011612"]) == [0.0]  # written as text: taken as written
    assert numeric_reward(["0.1", "0.10000000149011612"], [0.1, column[0]]) == [1.0, 1.0]


def test_latex_numbers_keep_reading_spaced_forms():
    # Their whitespace is matched possessively (a fraction's parts stripped after), against runaway
    # backtracking: every spaced form must still read as it did with the overlapping quantifiers.
    assert latex_numbers(r"\frac{ 1 }{ 2 } and \dfrac {-3} { 4 }") == "1/2 and -3/4"
    assert latex_numbers(r"\frac{1 2}{3}") == "1 2/3"
    assert latex_numbers("2 ^ { 3 }, 2^ 3, 2^{3") == "8, 8, 2^{3"
    assert latex_numbers(r"2 \times 10^{ 3 } or 2 x 10 ^ { -3 } ") == "2e3 or 2e-3 "
    assert parse_numbers(r"\boxed{\frac{ 1 }{ 2 }}") == [0.5]


# A completion that ran on in spaces up to the length limit. Whitespace quantifiers that could share a run
# of spaces split it every way: 2000 spaces after "\frac{" took 7 s to score, 4000 took 47 s (cubic), and
# the quadratic ones seconds at 10000, long enough to stall a DDP rank into the collective timeout.
RUNAWAY = " " * 64_000


# Reading is linear, milliseconds here; backtracking took minutes. No time is asserted (a loaded machine
# would fail it for nothing): the timeout mark ends a regression rather than hanging the run.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("read", "text", "expected"),
    [
        (parse_numbers, "Let me compute \\frac{" + RUNAWAY + "x", []),
        (parse_numbers, "\\frac{1}{" + RUNAWAY + "x", [1.0]),
        (parse_numbers, "2^" + RUNAWAY + "x", [2.0]),
        (parse_numbers, "2 x 10^" + RUNAWAY, [2.0, 10.0]),
        (normalize, "2^" + RUNAWAY + "x", "2 x"),
        (normalize, "\\frac{" + RUNAWAY + "x", "frac x"),  # accuracy_reward's reading
        (parse_choice, RUNAWAY + "B or C", None),
        (parse_choice, "The answer" + RUNAWAY + ".", None),
        (parse_box, "(1,2)" + RUNAWAY + "x", None),
        # what follows the spaces is still read (these matched at the first try, quickly, before too)
        (parse_numbers, "2 x 10^" + RUNAWAY + "{3}", [2000.0]),
        (parse_choice, RUNAWAY + "B", "B"),
        (parse_choice, "Answer:" + RUNAWAY + "b", "B"),
        (parse_box, "(1,2)" + RUNAWAY + "(3,4)", (1.0, 2.0, 3.0, 4.0)),
    ],
)
def test_runaway_whitespace_is_read_promptly(read, text, expected):
    assert read(text) == expected
