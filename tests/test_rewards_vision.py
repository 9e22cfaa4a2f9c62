"""Vision rewards on hand-made cases: box parsing, IoU/GIoU, and count, number, choice and OCR answers."""

from __future__ import annotations

import json

import pytest

from lightning_vlm.rewards.answers import count_reward, numeric_reward, parse_number
from lightning_vlm.rewards.boxes import box_giou, box_iou, giou_reward, iou_reward, parse_box
from lightning_vlm.rewards.choices import multiple_choice_reward, parse_choice

# ---------------------------------------------------------------- box parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 2, 3, 4]", (1, 2, 3, 4)),
        ("[1,2,3,4]", (1, 2, 3, 4)),
        ("The box is (1.5, 2, 3.25, 4).", (1.5, 2, 3.25, 4)),
        ("(1,2),(3,4)", (1, 2, 3, 4)),
        ("( 1 , 2 ) ( 3 , 4 )", (1, 2, 3, 4)),
        (
            "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(10,20),(30,40)<|box_end|>",
            (10, 20, 30, 40),
        ),
        ('{"bbox_2d": [10, 20, 30, 40], "label": "cat"}', (10, 20, 30, 40)),
        ('```json\n[{"bbox": [0.1, 0.2, 0.3, 0.4]}]\n```', (0.1, 0.2, 0.3, 0.4)),
        ("[-5, -2.5, 3e1, 4]", (-5, -2.5, 30, 4)),
        ("[2, 2, 2, 2]", (2, 2, 2, 2)),  # zero area parses
        ("first [1, 2, 3, 4] then [5, 6, 7, 8]", (1, 2, 3, 4)),
        ("<think>maybe [0, 0, 9, 9]</think><answer>[1, 2, 3, 4]</answer>", (1, 2, 3, 4)),
        ("<answer>[0, 0, 9, 9]</answer><answer>[1, 2, 3, 4]</answer>", (1, 2, 3, 4)),
    ],
)
def test_parse_box_syntaxes(text, expected):
    assert parse_box(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text",
    [
        "no box here",
        "[1, 2, 3]",
        "[1, 2, 3, 4, 5]",
        "[1, 2, 3, 4)",
        "[3, 2, 1, 4]",  # x2 < x1
        "[1, 4, 3, 2]",  # y2 < y1
        "[1e999, 0, 2e999, 1]",  # not finite
        "[1, 2, 3, 4] <answer>none</answer>",  # the answer block holds no box
    ],
)
def test_parse_box_rejects(text):
    assert parse_box(text) is None


def test_parse_box_formats_all_give_xyxy():
    assert parse_box("[10, 20, 30, 40]", "xywh") == (10, 20, 40, 60)
    assert parse_box("[10, 20, 4, 6]", "cxcywh") == (8, 17, 12, 23)
    assert parse_box("(10,20),(30,40)", "xywh") == (10, 20, 40, 60)
    assert parse_box("[10, 20, -1, 5]", "xywh") is None
    with pytest.raises(ValueError, match="unknown box_format 'yxyx'"):
        parse_box("[1, 2, 3, 4]", "yxyx")


# ---------------------------------------------------------------- IoU and GIoU


def test_iou_and_giou_hand_values():
    a, b = (0, 0, 2, 2), (1, 1, 3, 3)
    # Intersection 1, union 4 + 4 - 1 = 7, enclosing box 3 x 3 = 9.
    assert box_iou(a, b) == pytest.approx(1 / 7)
    assert box_giou(a, b) == pytest.approx(1 / 7 - (9 - 7) / 9)
    assert box_iou(a, b) == box_iou(b, a) and box_giou(a, b) == box_giou(b, a)
    # Disjoint: IoU 0, GIoU -(hull - union) / hull with hull 3 x 2 = 6, union 1 + 2; touching: 0.
    assert box_iou((0, 0, 1, 1), (2, 0, 3, 2)) == 0.0
    assert box_giou((0, 0, 1, 1), (2, 0, 3, 2)) == pytest.approx(-(6 - 3) / 6)
    assert box_giou((0, 0, 1, 1), (1, 0, 2, 1)) == pytest.approx(0.0)
    # Far apart tends to -1.
    assert box_giou((0, 0, 1, 1), (1000, 1000, 1001, 1001)) == pytest.approx(-1.0, abs=1e-5)
    # Containment: the hull is the outer box, so GIoU equals IoU.
    inner, outer = (1, 1, 2, 2), (0, 0, 4, 4)
    assert box_iou(inner, outer) == pytest.approx(1 / 16)
    assert box_giou(inner, outer) == pytest.approx(1 / 16)
    assert box_iou(a, a) == 1.0 and box_giou(a, a) == 1.0


def test_zero_area_boxes():
    point = (1, 1, 1, 1)
    assert box_iou(point, point) == 1.0 and box_giou(point, point) == 1.0
    assert box_iou(point, (0, 0, 2, 2)) == 0.0
    assert box_giou(point, (0, 0, 2, 2)) == pytest.approx(0.0)  # hull is the box: 0 - 0/4
    assert box_iou(point, (2, 2, 2, 2)) == 0.0 and box_giou(point, (2, 2, 2, 2)) == -1.0
    assert box_giou((0, 0, 0, 0), (3, 0, 3, 0)) == -1.0  # hull without area


def test_iou_reward_values_threshold_and_missing():
    completions = ["[0, 0, 2, 2]", "<answer>[1, 1, 3, 3]</answer>", "no box", "[0, 0, 2, 2]", "[5, 5, 6, 6]"]
    solution = ["[1, 1, 3, 3]", "[1, 1, 3, 3]", "[1, 1, 3, 3]", None, (0, 0, 2, 2)]
    assert iou_reward(completions, solution) == pytest.approx([1 / 7, 1.0, 0.0, None, 0.0])
    binary = iou_reward(completions, solution, threshold=0.5)
    assert binary == [0.0, 1.0, 0.0, None, 0.0]
    assert iou_reward(["[0, 0, 2, 2]"], ["[1, 1, 3, 3]"], threshold=1 / 7) == [1.0]
    with pytest.raises(ValueError, match="threshold"):
        iou_reward(completions, solution, threshold=1.5)


def test_giou_reward_is_rescaled_to_unit_interval():
    completions = ["[0, 0, 2, 2]", "[1, 1, 3, 3]", "garbage", "[100, 100, 101, 101]"]
    rewards = giou_reward(completions, ["[1, 1, 3, 3]"] * 4)
    assert rewards[0] == pytest.approx((1 / 7 - 2 / 9 + 1) / 2)
    assert rewards[1] == 1.0
    assert rewards[2] == 0.0  # no box: the minimum, below any box
    assert 0.0 < rewards[3] < 0.05


def test_box_rewards_in_normalized_and_pixel_coordinates_agree():
    pixel = iou_reward(["[0, 0, 200, 200]"], ["[100, 100, 300, 300]"])
    normalized = iou_reward(["[0, 0, 0.2, 0.2]"], ["[0.1, 0.1, 0.3, 0.3]"], coordinates="normalized")
    norm1000 = giou_reward(["(0,0),(200,200)"], [[100, 100, 300, 300]], coordinates="norm1000")
    assert pixel == pytest.approx([1 / 7]) and normalized == pytest.approx([1 / 7])
    assert norm1000 == pytest.approx([(1 / 7 - 2 / 9 + 1) / 2])
    # A normalised completion past the image edge is clipped to it.
    assert iou_reward(["[0.5, 0.5, 1.5, 1.5]"], ["[0.5, 0.5, 1, 1]"], coordinates="normalized") == [1.0]
    # One wholly past the edge has no area left in the image: the floor, as no box, not the GIoU of
    # a sliver on the border (0.5, more than a wrong box inside the image earns).
    beyond = ["[1.5, 1.5, 2, 2]", "[0, 0, 0.1, 0.1]"]
    rewards = giou_reward(beyond, ["[0.5, 0.5, 1, 1]"] * 2, coordinates="normalized")
    assert rewards[0] == 0.0 and 0.0 < rewards[1] < 0.5
    assert giou_reward(["(1100,1100),(1200,1200)"], [[500, 500, 1000, 1000]], coordinates="norm1000") == [0.0]
    assert iou_reward(beyond[:1], ["[0.5, 0.5, 1, 1]"], coordinates="normalized") == [0.0]
    # xywh applies to the solution too.
    assert iou_reward(["[1, 1, 2, 2]"], ["[1, 1, 2, 2]"], box_format="xywh") == [1.0]


def test_box_reward_errors():
    with pytest.raises(ValueError, match=r"iou_reward needs a `solution` column.*\['prompts'\]"):
        iou_reward(["[1, 2, 3, 4]"], prompts=["p"])
    # the trainer's own columns are not listed, and the setting that maps a column is named
    with pytest.raises(
        ValueError, match=r"were \['answer', 'prompts'\]\. .*data\.column_map=\{<column>: solution\}"
    ):
        iou_reward(["[1, 2, 3, 4]"], prompts=["p"], answer=["x"], completion_ids=[[1]], trainer_state=None)
    with pytest.raises(ValueError, match=r"giou_reward: row 1: cannot read a box from the solution 'left'"):
        giou_reward(["[1, 2, 3, 4]"] * 2, ["[1, 2, 3, 4]", "left"])
    with pytest.raises(ValueError, match=r"iou_reward: row 0: cannot read a box.*\[1, 2\]"):
        iou_reward(["[1, 2, 3, 4]"], [[1, 2]])
    with pytest.raises(
        ValueError, match=r"row 0: the solution box .* outside 0..1 of coordinates='normalized'"
    ):
        iou_reward(["[1, 2, 3, 4]"], ["[10, 20, 30, 40]"], coordinates="normalized")
    with pytest.raises(ValueError, match="unknown coordinates 'percent'"):
        iou_reward([], [], coordinates="percent")
    # Several boxes in one solution are no one reference, as JSON text as well as JSON data (the text's
    # first box was taken, silently).
    two = '[{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8]}]'
    for reference in (two, json.loads(two), "[1, 2, 3, 4] or [5, 6, 7, 8]"):
        with pytest.raises(ValueError, match=r"row 0: the solution .* holds 2 boxes"):
            iou_reward(["[1, 2, 3, 4]"], [reference])


def test_box_rewards_take_conversational_completions():
    plain = [{"role": "assistant", "content": "It is at [0, 0, 2, 2]."}]
    typed = [{"role": "assistant", "content": [{"type": "text", "text": '{"bbox_2d": [1, 1, 3, 3]}'}]}]
    assert iou_reward([plain, typed], solution=["[0, 0, 2, 2]", "[0, 0, 2, 2]"]) == pytest.approx(
        [1.0, 1 / 7]
    )


# ---------------------------------------------------------------- counts and numbers


def test_count_reward_words_and_digits():
    completions = [
        "three",
        "There are 3 shapes.",
        "<answer>Two</answer>",
        "3.0",
        "twenty",
        "four",
        "none",
        "3rd",
    ]
    solution = [3, "3", "two", "three", 20, 3, 3, 3]
    assert count_reward(completions, solution) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert count_reward(["twenty-one", "one"], ["1", None]) == [0.0, None]
    # "none" is a count of zero (it scored 0.0 against a solution of 0); "no" is not read as one
    zeros = ["none", "<answer>None</answer>", "There are none.", "0", "zero", "no", "none of the 2"]
    assert count_reward(zeros, [0, 0, "none", "zero", 0, 0, 0]) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # one count, named twice, is an answer; several different counts are a hedge
    hedges = [
        "3 shapes: three",
        "two or three",
        "three two",
        "two four four",
        "<answer>3</answer> of 4 cells",
    ]
    assert count_reward(hedges, [3, 3, 3, 2, 3]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"count_reward: row 0: cannot read a count .* 'many'"):
        count_reward(["3"], ["many"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1,234.5", 1234.5),
        ("3/4", 0.75),
        ("-2", -2.0),
        ("50%", 50.0),
        ("about .5 m", 0.5),
        ("x = 1e-3", 1e-3),
        ("\u22127", -7.0),  # the Unicode minus sign
        ("area 12 cm^2", 12.0),  # a unit's exponent is not a number of the answer
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == pytest.approx(value)


def test_parse_number_none():
    assert parse_number("no digits") is None
    assert parse_number("1/0") is None


def test_numeric_reward_tolerance_edges():
    assert numeric_reward(["<answer>1,234.5</answer>", "3/4", "0.7500", "2"], ["1234.5", 0.75, "3/4", 3]) == [
        1.0,
        1.0,
        1.0,
        0.0,
    ]
    assert numeric_reward(["1.0000001"], [1.0]) == [0.0]  # exact by default
    assert numeric_reward(["101", "102"], [100, 100], rel_tol=0.01) == [1.0, 0.0]
    assert numeric_reward(["0.001"], [0], rel_tol=0.5) == [0.0]  # relative to 0, nothing is close
    assert numeric_reward(["0.001", "0.0011"], [0, 0], abs_tol=0.001) == [1.0, 0.0]
    assert numeric_reward(["no number", "5"], ["5", float("nan")]) == [0.0, None]
    # every number named must be close: a hedge scores 0 unless all its numbers are within the tolerance
    hedges = [
        "48 or 60",
        "48 or 50",
        "width 48, i.e. 48.0",
        "<think>3 sides</think><answer>48</answer>",
        "1/0",
    ]
    assert numeric_reward(hedges, [48] * 5, abs_tol=4) == [0.0, 1.0, 1.0, 1.0, 0.0]
    # units: an exponent or a digit glued to a unit ("m2", "cm^2") is not a second number
    units = ["<answer>12 cm^2</answer>", "3 m2", "12 m^2 or 13 m^2", "\u22127", "-7"]
    assert numeric_reward(units, [12, 3, 12, 7, "\u22127"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"numeric_reward: row 0: cannot read a number"):
        numeric_reward(["5"], ["five"])
    with pytest.raises(ValueError, match="tolerances"):
        numeric_reward(["5"], ["5"], rel_tol=-1)


# ---------------------------------------------------------------- multiple choice


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("B", "B"),
        ("b", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("Answer: B", "B"),
        ("the answer is b", "B"),
        ("The correct option is (c) because it is red.", "C"),
        ("B. The blue one", "B"),
        ("A cat is shown, so the answer is D.", "D"),
        ("the answer is a.", "A"),
        ("<think>A or B?</think><answer>B</answer>", "B"),
        ("B, as B is blue", "B"),
        ("B or C", None),
        ("The answer is B, not C.", None),
        ("the answer is a cat", None),
        ("A is correct", "A"),  # a verb follows: the option, not the article
        ("I think A fits best", "A"),
        ("A red circle, so C", "C"),
        ("(B) A Red Circle", "B"),  # an option's text in Title Case: "A" is still the article
        ("A Red Circle, so C", "C"),
        ("A Is correct", "A"),
        (r"\boxed{C}", "C"),
        ("nothing", None),
        ("Z", None),
        ("'B'", "B"),  # straight quotes, as models write them; curly ones already counted
        ("The answer is 'B'.", "B"),
        ("'b'", "B"),  # a whole answer, in any case
        ("The answer is 'b'.", "B"),  # after a cue word too
        ("option 'c'", "C"),
        ("Spelled with an 'a', the answer is (C)", "C"),
        ('The answer is "B".', "B"),
        ("‘B’", "B"),
        ("I'm sure it's 'C', not 'D'", None),
    ],
)
def test_parse_choice(text, letter):
    assert parse_choice(text) == letter


def test_the_pronoun_i_is_not_option_i():
    ten = "ABCDEFGHIJ"  # ten options (MMLU-Pro): "I" is one of them
    assert parse_choice("I think the answer is B.", ten) == "B"
    assert parse_choice("I pick C", ten) == "C"
    assert parse_choice("I'm sure it is C", ten) == "C"
    assert parse_choice("I is correct", ten) == "I"
    assert parse_choice("The answer is I.", ten) == "I"
    assert parse_choice("(I)", ten) == "I"
    assert parse_choice("I", ten) == "I"
    assert multiple_choice_reward(["I think the answer is B."], ["B"], choices=ten) == [1.0]


def test_multiple_choice_reward():
    completions = ["(B)", "answer is c", "B or C", "D", [{"role": "assistant", "content": "Answer: A"}]]
    assert multiple_choice_reward(completions, ["B", "C", "B", "(d)", "a"]) == [1.0, 1.0, 0.0, 1.0, 1.0]
    # Letters outside the choices are not options.
    assert multiple_choice_reward(["E", "B (see E)"], ["B", "B"], choices="ABCD") == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"row 1: cannot read one option letter .* 'maybe'"):
        multiple_choice_reward(["B", "B"], ["B", "maybe"])
    with pytest.raises(ValueError, match="distinct letters"):
        multiple_choice_reward(["B"], ["B"], choices="AAB")


# ---------------------------------------------------------------- found by review: thinking, hedges, tolerance


def test_an_untagged_answer_is_read_after_the_reasoning():
    # A Qwen3-VL-style completion: reasoning closed by </think>, then the answer without <answer> tags. The
    # first box (or count) of the whole text was a draft inside the reasoning.
    box = (
        "The red shape could be [0, 0, 28, 28]; no, that one is blue.\n</think>\n\n"
        '```json\n[{"bbox_2d": [28, 0, 56, 28], "label": "red shape"}]\n```'
    )
    assert iou_reward([box], ["[28, 0, 56, 28]"]) == [1.0]
    assert count_reward(["I see two... no, three.</think>\n3"], [3]) == [1.0]
    assert numeric_reward(["maybe 20 px</think> 24 px"], [24]) == [1.0]
    assert parse_choice("A or B? B fits.</think>\nB") == "B"
    # Tags still win, wherever they are.
    assert count_reward(["<answer>3</answer> then 2</think> 2"], [3]) == [1.0]


def test_a_negative_count_is_no_count():
    assert count_reward(["-3", "\u22123", "3-4", "3"], [3, 3, 3, 3]) == [0.0, 0.0, 0.0, 1.0]


def test_numeric_tolerance_is_relative_to_the_solution():
    # ChartQA's relaxed accuracy: |answer - solution| <= rel_tol * |solution|. math.isclose measured against
    # the larger value, so overestimates got more room, and rel_tol >= 1 accepted any positive number.
    assert numeric_reward(["104.9", "95.1", "105.2", "94.8"], [100] * 4, rel_tol=0.05) == [1.0, 1.0, 0.0, 0.0]
    assert numeric_reward(["1000000", "200"], [1, 100], rel_tol=0.5) == [0.0, 0.0]
    assert numeric_reward(["1.4"], [1], rel_tol=0.5) == [1.0]


def test_a_power_is_read_by_value():
    assert parse_number("10^3") == 1000.0 and parse_number("2^10") == 1024.0
    assert parse_number("10^{-2}") == pytest.approx(0.01)
    assert numeric_reward(["10^3", "10^3"], [1000, 10]) == [1.0, 0.0]
    assert parse_number("area 12 cm^2") == 12.0  # a unit's exponent is still no number
    # A fractional exponent is not read as a power (it read "4^0.5" as 1.5), nor a list's "000^2".
    assert parse_number("4^0.5") == 4.0 and parse_number("1,000^2") == 1000.0


def test_a_solution_listing_numbers_accepts_any_of_them():
    assert count_reward(["4", "5"], [[3, 4], (3, 4)]) == [1.0, 0.0]
    assert numeric_reward(["25"], [(24, 25)]) == [1.0]


def test_hedges_and_echoed_options_name_no_single_choice():
    listed = "\n".join(
        f"{letter}. {colour}" for letter, colour in zip("ABCD", ["red", "green", "blue", "pink"], strict=True)
    )
    for hedge in (listed, "A or B", "A and C", "A) red or B) blue", "A. red, B. blue", "B. blue; C. pink"):
        assert parse_choice(hedge) is None, hedge
    assert multiple_choice_reward([listed, "A or B"], ["A", "B"]) == [0.0, 0.0]
    # An option's own text keeps its capitals: one letter named.
    for answer, letter in (
        ("B. Vitamin C", "B"),
        ("B. It is C.", "B"),
        ("A) red", "A"),
        ("A cat or a dog: B", "B"),
    ):
        assert parse_choice(answer) == letter, answer
