"""What the answer rewards read as a reference and as a number: a list of accepted answers (VQA's) for
every answer reward, thousands separators only where they can be one, and off-range boxes as no box."""

from __future__ import annotations

import pytest

from lightning_vlm.rewards.accuracy import answers_match, normalize
from lightning_vlm.rewards.answers import count_reward, numeric_reward, parse_count, parse_numbers
from lightning_vlm.rewards.boxes import giou_reward, iou_reward
from lightning_vlm.rewards.choices import multiple_choice_reward
from lightning_vlm.rewards.ocr import ocr_reward


def test_a_list_of_accepted_answers_scores_the_best_of_them_in_every_answer_reward():
    # TextVQA / VQAv2 rows carry every annotator's answer: any one of them is right.
    assert ocr_reward(["red", "crimsn"], solution=[["red", "crimson"]] * 2) == [1.0, 1 - 1 / 7]
    assert numeric_reward(["30", "29"], solution=[["28", "30"]] * 2) == [1.0, 0.0]
    assert count_reward(["4", "5"], solution=[["3", "4"]] * 2) == [1.0, 0.0]
    assert multiple_choice_reward(["B", "C"], solution=[["B", "b"]] * 2) == [1.0, 0.0]
    # blank annotations are no answers; a list of only blanks is a missing cell
    assert numeric_reward(["7"], solution=[["", "7"]]) == [1.0]
    assert count_reward(["7"], solution=[["", " "]]) == [None]
    # an unreadable accepted answer is a dataset error naming the row, as a single one is
    with pytest.raises(ValueError, match="count_reward: row 0: cannot read a count"):
        count_reward(["4"], solution=[["4", "many"]])


def test_a_box_solution_given_as_four_strings_is_still_one_box():
    assert iou_reward(["[0, 0, 10, 10]"], solution=[["0", "0", "10", "10"]]) == [1.0]


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("1,234", [1234.0]),
        ("1,234,567.5", [1234567.5]),
        ("12,3456", [12.0, 3456.0]),  # not groups of three: two numbers, no digit dropped
        ("0,125", [0.0, 125.0]),  # a thousands number never starts with a 0 group
        ("[112,0,224,112]", [112.0, 0.0, 224.0, 112.0]),  # a comma list: "224,112" is no thousands
        ("1,234,5", [1.0, 234.0, 5.0]),
    ],
)
def test_comma_thousands_only_where_they_can_be_one(text, numbers):
    assert parse_numbers(text) == numbers


def test_a_compact_box_matches_the_spaced_one():
    assert normalize("[112,0,224,112]") == normalize("[112, 0, 224, 112]")
    assert answers_match("[112,0,224,112]", "[112, 0, 224, 112]")


def test_count_reward_reads_thousands_as_numeric_reward_does():
    assert parse_count("1,234") == 1234.0
    assert count_reward(["1,234", "1234", "1"], solution=["1,234"] * 3) == [1.0, 1.0, 0.0]
    assert count_reward(["1,234"], solution=[1234]) == [1.0]
    assert count_reward(["1, 2, 3"], solution=[3]) == [0.0]  # a list of counts hedges


def test_a_zero_area_box_wholly_outside_the_range_is_no_box():
    # A point or line past the edge: as "no box" (GIoU's floor), not a box touching the reference.
    outside = ["[1.5,0.2,1.5,0.4]", "[1.5,0.2,1.6,0.4]", "no box"]
    assert giou_reward(outside, solution=["[0.5,0,1,0.5]"] * 3, coordinates="normalized") == [0.0] * 3
    assert giou_reward([outside[0]], solution=["[0.2,0.2,0.4,0.4]"], coordinates="normalized") == [0.0]
    # a line inside the range is a box (of no area): GIoU scores how far it is from the reference
    inside = giou_reward(["[0.3,0.3,0.3,0.35]"], solution=["[0.2,0.2,0.4,0.4]"], coordinates="normalized")
    assert inside[0] > 0.0


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("B. Vitamin C", "B"),  # the option's text echoed: its capital C is no second option
        ("c) yellow", "C"),
        ("(B) Grade A", "B"),
        ("B. blue, or (C)", None),  # a marked letter after it still hedges
        ("B. blue, the answer is C", None),
        ("E. see B", "B"),  # a leading letter outside the choices is no option
        # after markdown and a cue too: these read C as a second option and scored 0
        ("Answer: B. Vitamin C", "B"),
        ("**B. Vitamin C**", "B"),
        ("The answer is (B) Vitamin C", "B"),
        ("**Answer:** B. Vitamin C", "B"),
        ("## The correct option is: c) Grade A", "C"),
        ("- choice = (B) Vitamin C", "B"),
        ("Answer: B. blue, or (C)", None),  # still a hedge, as without the cue
        ("The answer is B, not C.", None),
        ("Answer: I think B. Vitamin C", None),  # no marker right after the cue: read as before
        ("Options: B. Vitamin C", None),  # "Options" is no cue
        # an echoed list in markdown is no answer, now that the first item's bullet is stripped
        ("- A. red\n- B. green", None),
        ("**A. red**\n**B. green**", None),
        ("* A) red\n* B) green", None),
    ],
)
def test_an_answer_opening_with_an_option_marker_names_that_option(text, letter):
    from lightning_vlm.rewards.choices import parse_choice

    assert parse_choice(text, "ABCD") == letter


def test_multiple_choice_reward_reads_the_option_after_a_cue_or_markdown():
    answers = ["Answer: B. Vitamin C", "**B. Vitamin C**", "The answer is (B) Vitamin C", "B. Vitamin C"]
    assert multiple_choice_reward(answers, ["B"] * 4, choices="ABCD") == [1.0] * 4


def test_a_box_solution_stored_as_json_data_is_read():
    # Qwen's grounding rows hold {"bbox_2d": [...], "label": ...}, alone or in a list
    qwen = {"bbox_2d": [0, 0, 10, 10], "label": "red square"}
    assert iou_reward(["[0, 0, 10, 10]"] * 3, solution=[qwen, [qwen], [[0, 0, 10, 10]]]) == [1.0] * 3
    with pytest.raises(ValueError, match="row 0: the solution .* holds 2 boxes"):
        iou_reward(["[0, 0, 10, 10]"], solution=[[qwen, {**qwen, "bbox_2d": [1, 1, 5, 5]}]])
    with pytest.raises(ValueError, match="row 0: cannot read a box from the solution"):
        iou_reward(["[0, 0, 10, 10]"], solution=[{"label": "red"}])


def test_ocr_reads_full_width_letters_and_ligatures_as_what_they_show():
    from lightning_vlm.rewards.ocr import ocr_similarity

    assert ocr_similarity("ＨＥＬＬＯ", "hello") == 1.0
    assert ocr_similarity("ﬁle", "file") == 1.0
    assert ocr_similarity("ＨＥＬＬＯ", "HELLO", normalize=False) == 0.0  # exact: as written


def test_an_empty_box_solution_is_a_missing_cell():
    # A row whose solution holds no box ([] in a bbox column) has no reference, as a blank answer cell
    # has: it scores None (left out of the reward), not an error that stops the run.
    assert iou_reward(["[0, 0, 10, 10]"] * 3, solution=[[], (), [0, 0, 10, 10]]) == [None, None, 1.0]
    assert giou_reward(["[0, 0, 10, 10]"], solution=[[]]) == [None]


def test_a_normalized_solution_under_norm1000_is_refused():
    # Completions in Qwen2-VL's 0..1000 against solutions in 0..1 never overlap: every reward would be
    # 0 with no sign why. A solution box wholly inside 0..1 names the setting to change.
    with pytest.raises(ValueError, match=r"row 0: .*within 0\.\.1.*coordinates='normalized'"):
        iou_reward(["[100, 100, 300, 300]"], solution=[[0.1, 0.1, 0.3, 0.3]], coordinates="norm1000")
    # In pixels (the default) both sides share whatever system the data uses: 0..1 boxes are fine.
    assert iou_reward(["[0.1, 0.1, 0.3, 0.3]"], solution=[[0.1, 0.1, 0.3, 0.3]]) == [1.0]


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("The answer I think is C", "C"),  # the pronoun after a cue word, among ten options
        ("My answer, I believe, is C", "C"),
        ("the answer is I think C", None),  # "is I" names I, then C: a hedge
        ("Answer: I", "I"),
        ("Answer: (I) because it fits", "I"),
        ("The answer is I because it is the only one.", "I"),  # "is" makes I the answer (a review's case)
        ("The correct option is I since the others fail", "I"),
        ("Answer: I because it fits", "I"),
    ],
)
def test_the_pronoun_i_after_a_cue_word_is_not_option_i(text, letter):
    from lightning_vlm.rewards.choices import parse_choice

    assert parse_choice(text, "ABCDEFGHIJ") == letter
