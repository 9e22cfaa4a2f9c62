"""The special tokens a VLM wrapper needs: the end-of-turn token, and the vision markers never to sample.

A weak (or tiny, random) policy samples image/video markers, and the next forward then fails on
"image tokens do not match"; HF and vLLM generation both suppress these ids. The common names are
listed here, and each family's extras (Gemma 4's audio markers, InternVL's ``<img>``) come from
its registry record.
"""

from __future__ import annotations

import re

from . import encoding
from .families import Family

# Processor/tokenizer attributes naming vision special tokens, across families.
VISION_TOKEN_ATTRS = (
    "image_token", "video_token", "boi_token", "eoi_token", "fake_image_token", "global_image_tag",
    "vision_start_token", "vision_end_token", "image_start_token", "image_end_token",
)  # fmt: skip
VISION_CONFIG_ID = re.compile(
    r"^(image|video|vision|boi|eoi)_.*token_(id|index)$|^(image|video)_token_(id|index)$"
)
# Fallback end-of-turn names when the template probe finds nothing.
END_OF_TURN_NAMES = ("<|im_end|>", "<end_of_turn>", "<end_of_utterance>", "<|eot_id|>", "<|end|>")


def end_of_turn_token(processor, tokenizer) -> str:
    """The token that closes an assistant turn: the first special token after its text in the template, up
    to the next turn's header where no token closes the turn (GLM-4.1V's models end an answer with the
    ``<|user|>`` that opens the next turn, one of the ids their generation config stops at)."""
    probe = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ZQXJ"}]},
        {"role": "user", "content": [{"type": "text", "text": "QZXV"}]},
    ]
    try:
        tail = encoding.render(processor, probe).split("ZQXJ", 1)[1]
        specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
        for token in tokenizer.tokenize(tail.split("QZXV", 1)[0]):
            if token in specials:
                return token
    except (IndexError, ValueError, TypeError):
        pass
    vocab = tokenizer.get_vocab()
    return next((name for name in END_OF_TURN_NAMES if name in vocab), tokenizer.eos_token)


def vision_special_ids(processor, tokenizer, config, family: Family) -> list[int]:
    """Ids of every image/video/vision marker the config, processor and tokenizer name, sorted."""
    extra_keys = set(family.suppress_config_keys)
    ids = {
        int(v)
        for k, v in config.to_dict().items()
        if (VISION_CONFIG_ID.match(k) or k in extra_keys) and isinstance(v, int)
    }
    vocab = tokenizer.get_vocab()
    for attr in (*VISION_TOKEN_ATTRS, *family.suppress_token_attrs):
        token = getattr(processor, attr, None) or getattr(tokenizer, attr, None)
        if isinstance(token, str) and token in vocab:
            ids.add(vocab[token])
    if family.suppress_token_pattern:  # e.g. Idefics3's tile markers
        ids |= {i for t, i in vocab.items() if re.fullmatch(family.suppress_token_pattern, t)}
    return sorted(ids)
