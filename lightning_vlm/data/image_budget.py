"""A pixel budget per image, applied when a row's images are decoded (``data.image_max_pixels`` and
``data.image_min_pixels``; both off by default).

An image over the budget is scaled down, keeping its aspect ratio, before anything sees it: the
processor, HF generate and vLLM (colocated or a server, which is sent these pixels) all get the same
smaller image, so they still agree token for token. Processor limits such as Qwen's ``max_pixels``
bound the vision tokens of one family only, and only after the full-size image has been held in
memory and, in server mode, encoded and sent whole. EasyR1 (``data.max_pixels`` / ``min_pixels``)
and LLaMA-Factory (``image_max_pixels`` / ``image_min_pixels``, whose names these are) resize their
rows the same way.

Scaling changes pixel coordinates: boxes written in the original image's pixels (a grounding
``solution``) no longer match what the model sees. Resized images log a warning saying so (the 1st,
2nd, 4th, ... of a run, ``recurring.warn_recurring``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image

from lightning_vlm.counts import check_count
from lightning_vlm.recurring import warn_recurring

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageBudget:
    """The pixel count (width x height) each decoded image is scaled into; None: no bound on that side."""

    max_pixels: int | None = None
    min_pixels: int | None = None

    def __post_init__(self) -> None:
        check_count("data.image_max_pixels", self.max_pixels, hint=" (pixels per image, width x height)")
        check_count("data.image_min_pixels", self.min_pixels, hint=" (pixels per image, width x height)")
        if self.max_pixels is not None and self.min_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(
                f"data.image_min_pixels={self.min_pixels} is over data.image_max_pixels={self.max_pixels}: "
                "no image size satisfies both"
            )

    def size_for(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) an image of this size is scaled to: the same aspect ratio up to rounding, at
        least ``min_pixels`` (each side rounded up), then at most ``max_pixels`` (each side rounded down), so
        the maximum holds where rounding cannot meet both; each side at least 1 pixel (a sliver's long side
        then shrinks more). Budgets of a few pixels distort the shape (1000x999 at 4 pixels is 2x1)."""
        pixels = width * height
        if self.min_pixels is not None and pixels < self.min_pixels:
            factor = math.sqrt(self.min_pixels / pixels)
            width, height = math.ceil(width * factor), math.ceil(height * factor)
        if self.max_pixels is not None and width * height > self.max_pixels:
            factor = math.sqrt(self.max_pixels / (width * height))
            width, height = max(1, math.floor(width * factor)), max(1, math.floor(height * factor))
            if width * height > self.max_pixels:  # a side held at 1 pixel: the other gives way
                if width >= height:
                    width = max(1, self.max_pixels // height)
                else:
                    height = max(1, self.max_pixels // width)
        return width, height

    def fit(self, image: Image.Image, stored_size: tuple[int, int] | None = None) -> Image.Image:
        """``image`` itself when it is within the budget, else a resized copy (bicubic, antialiased).

        ``stored_size``: the (upright) size of the image as stored, when it was decoded smaller (a JPEG's
        draft scale); the size it is scaled to follows from that, whatever scale it was decoded at."""
        stored_size = image.size if stored_size is None else stored_size
        size = self.size_for(*stored_size)
        if size != stored_size:  # said also when the draft scale alone gave that size
            _warn(stored_size, size)
        return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


BUDGET_SETTINGS = ("image_max_pixels", "image_min_pixels")


def warn_changed_budget(
    ckpt_path: str | None, trained: Mapping[str, Any] | None, data: Mapping[str, Any]
) -> None:
    """Warns, naming them, when ``ckpt_path``'s run scaled its images into another budget than ``data``'s
    settings do: a resumed run or an evaluation would then see other pixels (often other image tokens) than
    the weights were trained on. ``trained``: the checkpoint's ``datamodule_hyper_parameters`` (None: none)."""
    if not trained:
        return
    changed = [
        f"data.{key}={data.get(key)!r} (checkpoint: {trained.get(key)!r})"
        for key in BUDGET_SETTINGS
        if trained.get(key) != data.get(key)  # a checkpoint from before these settings: None, as the default
    ]
    if changed:
        log.warning(
            "ckpt_path=%r trained on images scaled into another pixel budget; this run's images differ from the "
            "ones it saw: %s",
            ckpt_path,
            ", ".join(changed),
        )


def _warn(before: tuple[int, int], after: tuple[int, int]) -> None:
    # Counted per process (a DataLoader worker counts its own), afresh in each run of a sweep.
    warn_recurring(
        log,
        "image_budget",
        "data.image_max_pixels / data.image_min_pixels resized an image (%dx%d -> %dx%d). Pixel coordinates "
        "in your data (boxes in a grounding solution) are then off: write them normalised (box rewards' "
        "coordinates: normalized or norm1000) or leave the images as they are",
        *before,
        *after,
        unit="image",
    )
