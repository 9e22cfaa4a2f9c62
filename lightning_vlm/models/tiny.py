"""The offline tiny-VLM zoo: random-weight models of each supported family, built from a recipe.

``tiny_vlm_path(family)`` returns a folder that ``AutoModelForImageTextToText``, ``AutoProcessor``
and vLLM all load. It is built once per recipe and cached on disk: the folder name carries a hash
of the recipe, so a changed recipe rebuilds and an unchanged one is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

from lightning_vlm.data import synthetic
from lightning_vlm.models.tiny_recipes import RECIPES, Recipe
from lightning_vlm.models.tiny_tokenizer import VOCAB_SIZE, train_tokenizer, training_corpus

# Bump when the build code changes what lands in the folder without changing a recipe.
RECIPE_VERSION = 1

# Every recipe is a tiny family; tests are parametrised over this (and the registry).
TINY_FAMILIES: tuple[str, ...] = tuple(RECIPES)


def default_cache_dir() -> pathlib.Path:
    """Where tiny models are cached: ``$LIGHTNING_VLM_CACHE`` or ``~/.cache/lightning_vlm/tiny``."""
    env = os.environ.get("LIGHTNING_VLM_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "lightning_vlm" / "tiny"


def recipe_hash(family: str, seed: int = 0) -> str:
    """A short hash of everything that defines ``family``'s tiny model, for its cache folder name."""
    recipe = {
        "version": RECIPE_VERSION,
        "family": family,
        "recipe": dataclasses.asdict(RECIPES[family]),
        "corpus": training_corpus(),
        "vocab_size": VOCAB_SIZE,
        "vocabulary": synthetic.VOCABULARY,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def tiny_vlm_path(family: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Folder of ``family``'s tiny random-weight VLM (model, tokenizer, processor), built if missing."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; expected one of {TINY_FAMILIES}")
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{family}-seed{seed}-{recipe_hash(family, seed)}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename it into place: a folder under the final name is always
    # complete, so concurrent test processes never read a half-written one.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{family}-building-", dir=root))
    try:
        build_tiny_vlm(family, tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race with another builder: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolve(value: Any, ids: dict[str, int], vocab_size: int) -> Any:
    """Replace ``"tok:<x>"`` by the id of token ``<x>`` and ``"vocab"`` by the vocabulary size."""
    if isinstance(value, dict):
        return {k: _resolve(v, ids, vocab_size) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, ids, vocab_size) for v in value]
    if isinstance(value, str) and value.startswith("tok:"):
        return ids[value[4:]]
    if value == "vocab":
        return vocab_size
    return value


def _hf_tokenizer(recipe: Recipe):
    """Train the tokenizer and wrap it with the family's named special tokens."""
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([*recipe.special.values(), *recipe.extra_special]))
    raw = train_tokenizer(specials, recipe.added, split_regex=recipe.split_regex)
    named = set(recipe.special.values())
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        # eos/pad/bos are standard attributes; others (image_token, boi_token...) become named
        # model-specific special tokens that processors read as tokenizer attributes.
        **recipe.special,
        extra_special_tokens=[t for t in recipe.extra_special if t not in named],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_vlm(family: str, out_dir: str | os.PathLike, seed: int = 0) -> None:
    """Build ``family``'s tiny model, tokenizer and processor and save them into ``out_dir``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lightning_vlm.models.weight_names import save_for_hf_and_vllm

    recipe = RECIPES[family]
    tokenizer = _hf_tokenizer(recipe)
    ids = tokenizer.get_vocab()
    config = AutoConfig.for_model(recipe.model_type, **_resolve(recipe.config, ids, len(tokenizer)))

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    save_for_hf_and_vllm(model, out_dir)

    ip_name, ip_kwargs = recipe.image_processor
    image_processor = getattr(transformers, ip_name)(**ip_kwargs)
    proc_name, proc_kwargs = recipe.processor
    extra = {
        name: getattr(transformers, cls)(**kwargs) for name, (cls, kwargs) in recipe.processor_parts.items()
    }
    processor = getattr(transformers, proc_name)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=recipe.chat_template,
        **extra,
        **proc_kwargs,
    )
    processor.save_pretrained(out_dir)
