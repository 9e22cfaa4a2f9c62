"""A byte-level BPE tokenizer trained locally, so the tiny models need no model hub."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_vlm.data import synthetic

if TYPE_CHECKING:
    import tokenizers

VOCAB_SIZE = 512

# Generic text so the tokenizer can spell anything; the task's words come on top of it.
_GENERIC = (
    "The quick brown fox jumps over the lazy dog. A picture shows an object on a plain background. "
    "Answer the question with one word. Describe the image in detail, please. Yes, no, maybe: 0 1 2 3 "
    "4 5 6 7 8 9 10. It is left of, right of, above and below the other one! Think step by step. "
    "<think> reasoning </think> <answer> result </answer> (x + y) * z = 42; \"quoted\" 'text' - done."
)


def training_corpus() -> list[str]:
    """The texts the tokenizer is trained on: the task's questions and answers, then generic text.

    Each vocabulary word is repeated, alone and after a space, far more often than any generic
    pair, so BPE's first merges spell every word whole in both positions.
    """
    words = list(synthetic.VOCABULARY)
    questions = list(synthetic.QUESTIONS.values())
    answers = [a for answers in synthetic.ANSWERS.values() for a in answers]
    task = [f"{q}\n{a}" for q in questions for a in answers]
    # The leading space makes the first word appear after a space too.
    return [w for w in words for _ in range(50)] + [" " + " ".join(words)] * 50 + task + [_GENERIC] * 3


def train_tokenizer(
    special: Sequence[str],
    added: Sequence[str] = (),
    vocab_size: int = VOCAB_SIZE,
    split_regex: str | None = None,
) -> tokenizers.Tokenizer:
    """Train the byte-level BPE with ``special`` tokens first (low ids) and ``added`` plain tokens.

    ``split_regex``: pre-split with this regex after an NFC normaliser, as the tokenizer classes of
    some families (Qwen3.5) rebuild on load; training the same pipeline keeps the ids equal.
    """
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: a word opening an assistant turn is spelled without a space, and
    # BPE learns both "red" and " red" as single tokens from the corpus.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_regex is not None:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if added:
        tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in added])
    return tok
