"""Decoding a row's images, and the one way every decoded image becomes 8-bit RGB (``to_rgb``).

``open_image``/``load_row`` are where a row's image references (paths, bytes, PIL images) are decoded
(and turned upright by their EXIF orientation); a missing or corrupt file raises :class:`~lightning_vlm.data.rows.RowError` naming the row. A plain ``image.convert("RGB")`` gets two common kinds of image silently wrong:

- **More than 8 bits per pixel** (PIL modes ``I;16*``, ``I``, ``F``: 16-bit PNGs, TIFF scans, depth
  maps) are *clipped* to 0..255, so a 16-bit image comes out almost all white. We scale instead:
  ``I;16*`` by its type's range (``round(v / 257)``: 65535 -> 255, and an 8-bit value stored as
  ``v * 257`` comes back exactly); ``I`` the same when every pixel is in 0..65535 (how PIL holds
  16-bit data it reads as 32-bit), ``F`` from 0..1 (the float-image convention) when every pixel is
  in 0..1; otherwise (32-bit counts, arbitrary floats) by the image's own min..max, so its full range
  maps to 0..255 (a constant image becomes black). NaNs count as the minimum.
- **Transparency** (``RGBA``, ``LA``, ``PA``, premultiplied ``RGBa``/``La``, or a palette/grey/RGB image
  with a transparent colour in ``info["transparency"]``) loses its alpha channel, leaving whatever
  colour the transparent pixels happened to store (usually black). We composite on ``background``
  (white by default: what a viewer shows for a transparent PNG; ``data.alpha_background``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from lightning_vlm.data.image_budget import ImageBudget
from lightning_vlm.data.row_error import RowError
from lightning_vlm.data.row_images import ImageRef
from lightning_vlm.data.rows import normalize_row

# Image file suffixes: a column of such paths is images (skips), a folder of such files an image folder.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")

RGB = tuple[int, int, int]
WHITE: RGB = (255, 255, 255)
_ORIENTATION = 0x0112  # the EXIF tag saying how a stored image is turned
_QUARTER_TURNS = (5, 6, 7, 8)  # its values that turn the image a quarter: width and height swap
ALPHA_MODES: frozenset[str] = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_SIXTEEN_BIT = 65535


def rgb_background(value: Any, setting: str = "data.alpha_background") -> RGB:
    """``value`` as an ``(r, g, b)`` tuple of ints in 0..255; anything else raises naming ``setting``."""
    ok = (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and len(value) == 3
        and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in value)
    )
    if not ok:
        raise ValueError(
            f"{setting} must be three integers 0..255 (red, green, blue), e.g. [255, 255, 255] for white; "
            f"got {value!r}"
        )
    return (int(value[0]), int(value[1]), int(value[2]))


def _to_8bit(pixels: np.ndarray, full_range: float) -> np.ndarray:
    """Pixels scaled to 0..255: from 0..``full_range`` when they all fit, else from their own min..max."""
    pixels = pixels.astype(np.float64)
    finite = np.isfinite(pixels)
    low = float(pixels[finite].min()) if finite.any() else 0.0
    high = float(pixels[finite].max()) if finite.any() else 0.0
    if low < 0 or high > full_range:
        # Outside the type's usual range: stretch the image's own range instead of clipping it.
        pixels, full_range = pixels - low, (high - low) or 1.0
    pixels = np.where(finite, pixels, 0.0)
    return np.clip(np.rint(pixels * (255.0 / full_range)), 0, 255).astype(np.uint8)


def to_8bit_grey(image: Image.Image) -> Image.Image:
    """A high-bit-depth single-channel image (``I;16*``, ``I``, ``F``) as 8-bit ``L``, scaled (module doc)."""
    pixels = np.asarray(image)
    if image.mode.startswith("I;16"):
        # Exact integer rounding of v * 255 / 65535 (= v / 257), without a float pass.
        scaled = (pixels.astype(np.uint32) * 255 + _SIXTEEN_BIT // 2) // _SIXTEEN_BIT
        return Image.fromarray(scaled.astype(np.uint8), "L")
    full_range = 1.0 if image.mode == "F" else float(_SIXTEEN_BIT)
    return Image.fromarray(_to_8bit(pixels, full_range), "L")


def has_alpha(image: Image.Image) -> bool:
    """Whether the image carries transparency: an alpha channel or a transparent colour key."""
    palette = image.palette.mode if image.mode == "P" and image.palette is not None else None
    return image.mode in ALPHA_MODES or "transparency" in image.info or palette == "RGBA"


def to_rgb(image: Image.Image, background: Sequence[int] = WHITE) -> Image.Image:
    """``image`` as 8-bit RGB: high bit depths scaled (not clipped), transparency composited on
    ``background`` (not dropped to black). Always a new image: the caller may close the one it opened."""
    if image.mode.startswith("I") or image.mode == "F":
        image = to_8bit_grey(image)  # a colour key of a 16-bit image no longer applies once scaled
    elif has_alpha(image):
        # PIL un-premultiplies "La" only into "LA" (RGBa -> RGBA it converts directly).
        rgba = (image.convert("LA") if image.mode == "La" else image).convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*rgb_background(background, "background"), 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def open_image(
    ref: ImageRef,
    index: int = 0,
    source: str = "data",
    column: str = "images",
    background: Sequence[int] = WHITE,
    budget: ImageBudget | None = None,
) -> Image.Image:
    """Load one image reference as 8-bit RGB (``to_rgb``: high bit depths scaled, transparency
    composited on ``background``), turned upright by its EXIF orientation as ``datasets`` and
    transformers' ``load_image`` do, and scaled into ``budget`` if one is given; a missing, corrupt or too
    large file raises RowError naming the row."""
    try:
        if isinstance(ref, Image.Image):
            # A PIL image in a row (opened by the user) is turned upright too, as transformers'
            # load_image turns one; not in place (it is the caller's), and the upright copy carries no
            # tag, so a second pass leaves it be.
            upright = ImageOps.exif_transpose(ref) if ref.getexif().get(_ORIENTATION, 1) != 1 else ref
            rgb = to_rgb(upright, background)
            return rgb if budget is None else budget.fit(rgb)
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as image:
            # The size it is scaled to follows from the stored size (upright). A JPEG is then decoded at the
            # smallest 1/2, 1/4 or 1/8 scale still at least that size (PIL's draft): a 12-megapixel photo
            # decodes in a fraction of the time and memory.
            stored = None
            if budget is not None:
                turned = image.getexif().get(_ORIENTATION, 1) in _QUARTER_TURNS
                stored = image.size[::-1] if turned else image.size
                if (target := budget.size_for(*image.size)) != image.size:
                    image.draft(image.mode, target)
            image.load()  # decode now, so a truncated file fails here and not inside the model
            # A phone photo is stored sideways with an EXIF tag saying how to turn it; the models are
            # trained on upright images (datasets' and transformers' decoders apply the tag too).
            # In place: to_rgb makes the one copy we return.
            ImageOps.exif_transpose(image, in_place=True)
            rgb = to_rgb(image, background)
            return rgb if budget is None else budget.fit(rgb, stored)
    except FileNotFoundError as e:
        raise RowError(source, index, column, "missing_image", f"image file not found: {ref}") from e
    # PIL's errors for unreadable files; DecompressionBombError (an image over 2 * MAX_IMAGE_PIXELS,
    # 179 Mpixel) subclasses none of them.
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        what = ref if isinstance(ref, str) else "image bytes"
        raise RowError(source, index, column, "corrupt_image", f"cannot decode {what}: {e}") from e


def load_row(
    row: Mapping,
    shape: str,
    index: int = 0,
    source: str = "data",
    base_dir: str | os.PathLike | None = None,
    background: Sequence[int] = WHITE,
    budget: ImageBudget | None = None,
) -> dict:
    """Normalise one raw row and load its images (RGB PIL, see ``open_image``), each scaled into ``budget``
    where one is given; the form DataModules yield."""
    out = normalize_row(row, shape, index, source, base_dir, check_files=False)
    column = "image" if row.get("image") is not None else "images"
    out["images"] = [open_image(ref, index, source, column, background, budget) for ref in out["images"]]
    return out
