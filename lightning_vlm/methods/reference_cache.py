"""Reference log-probs computed once and reused (``precompute_ref_logps``), keyed so stale values are never read.

Other libraries refuse to precompute for image data because a row's text alone does not identify
it. Here every entry is keyed by the row's full content, image pixels included (:func:`row_key`),
and each file by the reference model (:func:`model_key`: model path, a fingerprint of every
reference weight, the processor's settings and chat template, the encoding settings). A changed image,
answer, checkpoint, image resolution or max_length therefore misses the cache and is recomputed; nothing
is ever invalidated by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from lightning_vlm.checkpoint_io import temp_name

log = logging.getLogger(__name__)

# Bump when the meaning of a stored value changes (e.g. how answers are tokenised). 2: prompts start with
# the tokenizer's BOS where the template writes none (chat_render.adds_bos: LLaVA-1.5, LLaVA-NeXT-Mistral).
FORMAT_VERSION = 2


def _image_digest(image) -> str:
    h = hashlib.sha256()
    if isinstance(image, Image.Image):
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    elif isinstance(image, bytes):
        h.update(image)
    else:  # a path not yet loaded: its bytes, not its name, identify it
        h.update(Path(image).read_bytes())
    return h.hexdigest()


def _digest(parts: list, images: list) -> str:
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for image in images:
        h.update(_image_digest(image).encode())
    return h.hexdigest()


def row_key(row: dict) -> str:
    """A digest of a preference row: prompt, chosen, rejected and every image's pixels."""
    return _digest([row.get("prompt"), row["chosen"], row["rejected"]], row.get("images", []))


def prompt_key(row: dict) -> str:
    """A digest of a row's prompt and every image's pixels: rows that ask the same question share it."""
    return _digest([row.get("prompt")], row.get("images", []))


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, skip: tuple[str, ...] = ("lora_",)) -> str:
    """A digest of every parameter and buffer (name, shape, dtype, values); ``skip`` drops adapter weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if any(s in name for s in skip):
            continue
        h.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        t = tensor.detach().cpu().contiguous()
        # Raw bytes: any change of any value changes the digest (bf16 has no numpy view, hence the cast).
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def processor_fingerprint(processor: ProcessorMixin | PreTrainedTokenizerBase) -> str:
    """A digest of the processor's settings and chat template: ``max_pixels``, tiling or a template change
    the tokens an image or a prompt becomes, hence the reference log-probs, for the same weights."""
    if isinstance(processor, ProcessorMixin):
        settings = processor.to_json_string()  # every sub-processor's settings, keys sorted
    else:
        settings = json.dumps(processor.init_kwargs, sort_keys=True, default=str)
    template = json.dumps(processor.chat_template, sort_keys=True, default=str)
    return hashlib.sha256(f"{settings}\n{template}".encode()).hexdigest()


def model_key(name_or_path: str, fingerprint: str, **settings) -> str:
    """The cache file's key: model path, weights fingerprint and the settings that change the values."""
    payload = json.dumps([FORMAT_VERSION, str(name_or_path), fingerprint, settings], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class ReferenceLogpCache:
    """Summed reference log-probs (chosen, rejected) per row, in ``directory`` under one model key."""

    def __init__(self, directory: str | os.PathLike, key: str, rank: int = 0) -> None:
        self.directory = Path(directory)
        self.key = key
        # Under DDP each rank writes its own file (its own data shard); reading merges them all.
        self.path = self.directory / f"ref-logps-{key}-rank{rank}.pt"
        self.values: dict[str, tuple[float, float]] = {}
        self.reload()
        self.dirty = False

    def reload(self) -> None:
        """Merge in every rank's file (after all ranks saved theirs, e.g. behind a barrier)."""
        for file in sorted(self.directory.glob(f"ref-logps-{self.key}-rank*.pt")):
            self.values.update(_read(file))

    def __len__(self) -> int:
        return len(self.values)

    def missing(self, rows: Iterable[dict]) -> list[int]:
        """Indices of the rows without a stored value."""
        return [i for i, row in enumerate(rows) if row_key(row) not in self.values]

    def get(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B]) float64 tensors; ``KeyError`` naming the first row not stored."""
        out = []
        for i, row in enumerate(rows):
            key = row_key(row)
            if key not in self.values:
                raise KeyError(
                    f"row {i} of the batch has no precomputed reference log-probs (key {key[:12]})"
                )
            out.append(self.values[key])
        values = torch.tensor(out, dtype=torch.float64).reshape(len(rows), 2)
        return values[:, 0], values[:, 1]

    def put(self, rows: list[dict], chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """Store the values of ``rows`` (kept in memory until :meth:`save`)."""
        for row, c, r in zip(rows, chosen.tolist(), rejected.tolist(), strict=True):
            self.values[row_key(row)] = (float(c), float(r))
        self.dirty = True

    def save(self) -> None:
        """Write atomically (a reader never sees half a file), merged with what other runs sharing the folder
        (a sweep's jobs) wrote since: one writer at a time, each under a temporary name of its own."""
        if not self.dirty:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f".{self.path.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as err:  # a filesystem without locks (Lustre without -o flock, some FUSE mounts)
                log.warning("no file lock in %s (%s): saving the reference log-probs unlocked; runs sharing "
                            "the folder may drop each other's rows (recomputed later)", self.directory, err)  # fmt: skip
            self.values = {**(_read(self.path) if self.path.is_file() else {}), **self.values}
            tmp = temp_name(self.path)
            try:
                torch.save(self.values, tmp)
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
        self.dirty = False


def _read(file: Path) -> dict[str, tuple[float, float]]:
    """One cache file's values; a damaged one (a copy cut short) is named and skipped: its rows are computed
    again, where it raised inside ``torch.load`` at every later run's start."""
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:
        log.warning("reference log-probs in %s could not be read (%s: %s): skipped, its rows are computed again",
                    file, type(err).__name__, str(err).splitlines()[0] if str(err) else "")  # fmt: skip
        return {}
