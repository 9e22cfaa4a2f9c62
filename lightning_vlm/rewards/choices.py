"""The multiple-choice answer reward: which option letter an answer names, and whether it is the solution's.

Follows the answer-reward convention of ``answers.py`` (``score_with_reference``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_vlm.rewards.accuracy import extract_answer
from lightning_vlm.rewards.answers import score_with_reference

if TYPE_CHECKING:
    from lightning_vlm.rewards.builtin import Completion

# Whitespace is matched possessively (\s*+) wherever two quantifiers could share a run of spaces: every
# way of splitting the run was tried, so 10000 leading spaces took 1.6 s here and "answer" then 800 spaces
# 3 s in _CUE_CHOICE (three quantifiers: cubic), time a runaway completion would hold its DDP rank for.
_WHOLE_CHOICE = re.compile(r"\s*+[(\['\"]?\s*+([A-Za-z])\s*+[)\]'\"]?\s*+[.:]?\s*+")
_PAREN_CHOICE = re.compile(r"[(\[]\s*([A-Za-z])\s*[)\]]")
# A capital in straight quotes ("the answer is 'B'"): the lone-capital rule leaves out letters next to an
# apostrophe ("I'm", "B's"), so quoted ones are marked here. Not lower case: "spelled with an 'a'".
_QUOTED_CHOICE = re.compile(r"(?<![\w'])'([A-Z])'(?![\w'])")
# A quote may open the letter ("the answer is 'b'"); after it, no word ("answer is a cat") and no
# apostrophe that starts one ("answer: I'm ...").
_CUE_CHOICE = re.compile(
    r"\b(?:answer|option|choice)(?:\s++is)?\s*+[:=]?\s*+[(\['\"]?\s*+([A-Za-z])(?!\w|'\w)", re.I
)
# What between a cue word and its letter makes the letter the answer: "answer is I", "Answer: I", "option (I)".
_CUE_SEPARATOR = re.compile(r"\bis\b|[:=(\[]", re.I)
# An answer opening with an option's marker, then its text: "B. Vitamin C", "(b) red", "c) yellow".
_LEADING_CHOICE = re.compile(r"\s*(?:[(\[]\s*([A-Za-z])\s*[)\]]|([A-Za-z])\s*[).:])\s+")
# What may come before that marker: markdown emphasis, a heading or a bullet, and a cue ("Answer:", "The
# answer is", "**Option** (B)"), so that "Answer: B. Vitamin C" reads as "B. Vitamin C" does.
_CUE_PREFIX = re.compile(
    r"[\s*_#-]*+(?:(?:the\s++)?+(?:(?:correct|final)\s++)?+(?:answer|option|choice)\b"
    r"(?:\s++is\b)?+\s*+[:=]?+[\s*_#-]*+)?+",
    re.I,
)
_UPPER_CHOICE = re.compile(r"(?<![\w'])([A-Z])(?![\w'])")
# Another option's marker after the first option's text: at a line start ("B. green" of an echoed list), or
# after a comma, semicolon, "or" or "and" ("A) red or B) blue", "A. red, B. blue"); markdown may open it
# ("- B. green", "**B. green**": a bulleted or bold list, now that a leading bullet is stripped).
_LISTED_CHOICE = re.compile(r"(?:^|[,;]|\bor\b|\band\b)[\s*_#-]*+[(\[]?([A-Z])[).:](?=\s|$)", re.M)
# The word after a letter: lower case, or Title Case of two letters or more ("A Red Circle": an option's
# text written in title case still reads "A" as the article).
_ARTICLE_NEXT = re.compile(r"\s+([a-z]+|[A-Z][a-z]+)")
# Words after a letter that make it an option, not the article: "A is correct", "I think A fits".
# Conjunctions too: "A or B", "A and C" name two options (a hedge), not the article.
_OPTION_VERBS = frozenset(
    {"is", "was", "seems", "looks", "fits", "matches", "would", "should", "must", "can"}
    | {"or", "and", "nor", "not", "but", "vs", "versus"}
)


def _is_word(answer: str, letter: str, end: int) -> bool:
    """Whether ``letter`` ending at ``end`` reads as a word, the article "A"/"a" or the pronoun "I": a
    lower-case word follows and it is not a verb ("a cat", "I think" are words; "A is right", "I is
    right" options; "A Red Circle" is Title Case, so a word). The pronoun matters once the options reach "I"
    (ten, as in MMLU-Pro)."""
    follow = _ARTICLE_NEXT.match(answer, end)
    return letter in "AaI" and follow is not None and follow.group(1).lower() not in _OPTION_VERBS


def _marked_mentions(answer: str) -> set[str]:
    """The letters marked as options: parenthesised, or after "answer", "option" or "choice"."""
    mentions = {m.group(1).upper() for p in (_PAREN_CHOICE, _QUOTED_CHOICE) for m in p.finditer(answer)}
    for match in _CUE_CHOICE.finditer(answer):
        # "the answer is a cat": a lower-case "a" followed by a word is the article. "The answer I think is
        # C": "I" right after the cue word (no "is", colon or bracket between) and followed by a word is the
        # pronoun; "the answer is I because ..." names option I.
        letter = match.group(1)
        bare = letter == "I" and not _CUE_SEPARATOR.search(answer, match.start(), match.start(1))
        if not ((letter == "a" or bare) and _is_word(answer, letter, match.end())):
            mentions.add(letter.upper())
    return mentions


def _choice_mentions(answer: str) -> set[str]:
    mentions = _marked_mentions(answer)
    for match in _UPPER_CHOICE.finditer(answer):
        # Lone capitals are options ("B is right", "B. blue"), except the article or the pronoun I.
        if not _is_word(answer, match.group(1), match.end()):
            mentions.add(match.group(1))
    return mentions


def parse_choice(text: str, choices: str = "ABCDEFGH") -> str | None:
    """The option letter the answer names (upper case), or None when it names none or several different ones.

    An answer that is just a letter counts in either case ("b", "(B)", "B."). In longer text a letter
    counts when it is parenthesised ("(b)") or a quoted capital ("'B'"), follows "answer", "option" or "choice" ("Answer: B",
    "the answer is b"), or stands alone as a capital ("I pick C"). An answer that opens with an option's
    marker and its text ("B. Vitamin C", "c) yellow"), also after markdown and a cue ("**B. Vitamin C**",
    "Answer: B. Vitamin C", "The answer is (B) Vitamin C"), names that letter, and capitals in the text are
    the text's; a marked letter after it ("B. blue, or (C)"), or another option's marker after a line
    start, a comma, "or" or "and" ("A. red, B. blue", an echoed list of options), still counts as
    another; "A"/"a" or "I" followed
    by a lower-case word other than a verb such as "is" or a conjunction ("A or B") reads as the
    article or the pronoun ("I pick C"
    names C also among ten options A-J). Letters outside ``choices`` are ignored.
    """
    answer = extract_answer(text)
    whole = _WHOLE_CHOICE.fullmatch(answer)
    leading = _LEADING_CHOICE.match(answer, _CUE_PREFIX.match(answer).end())
    letter = leading and next(g for g in leading.groups() if g).upper()
    if whole is not None:
        mentions = {whole.group(1).upper()}
    elif letter and letter in choices.upper():
        # "B. Vitamin C": the option's text follows its letter, and its capitals are the text's.
        rest = answer[leading.end() :]
        mentions = {letter} | _marked_mentions(rest) | {m.group(1) for m in _LISTED_CHOICE.finditer(rest)}
    else:
        mentions = _choice_mentions(answer)
    mentions &= set(choices.upper())
    return mentions.pop() if len(mentions) == 1 else None


def _check_choices(choices: str) -> str:
    letters = choices.upper()
    if not letters or not letters.isalpha() or not letters.isascii() or len(set(letters)) != len(letters):
        raise ValueError(
            f"multiple_choice_reward: choices must be distinct letters such as 'ABCD'; got {choices!r}"
        )
    return letters


def multiple_choice_reward(
    completions: Sequence[Completion],
    solution: Sequence[Any] | None = None,
    *,
    choices: str = "ABCDEFGH",
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the completion names exactly the solution's option letter (see ``parse_choice``), else 0.0.

    A completion naming several different letters ("B or C", "B, not C") scores 0.0: hedging
    between options must not be rewarded.
    """
    letters = _check_choices(choices)

    def read(ref: Any) -> str:
        letter = parse_choice(str(ref), letters)
        if letter is None:
            raise ValueError(f"cannot read one option letter of {letters!r} from the solution {ref!r}")
        return letter

    return score_with_reference(
        "multiple_choice_reward",
        completions,
        solution,
        kwargs,
        read,
        lambda text, ref: 1.0 if parse_choice(text, letters) == ref else 0.0,
    )
