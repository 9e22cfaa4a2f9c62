"""A row's image columns (``image`` or ``images``) read into references: paths made absolute and
checked, encoded bytes, PIL images; what cannot be one is refused naming the row and column."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from PIL import Image

from lightning_vlm.data.row_error import RowAt

# An image before loading: a PIL image, encoded bytes, or an absolute path.
ImageRef = Image.Image | bytes | str


def _resolve(path: str | os.PathLike, base_dir: Path | None) -> str:
    path = Path(path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return str(path)


def _image_ref(value: Any, at: RowAt, column: str, base_dir: Path | None, check_files: bool) -> ImageRef:
    if isinstance(value, Image.Image | bytes):
        return value
    if isinstance(value, Mapping):  # how `datasets` stores an undecoded Image feature
        if value.get("bytes") is not None:
            if not isinstance(value["bytes"], bytes):
                at.fail(column, "wrong_type", f"an image's 'bytes' must be the encoded file's bytes, got "
                        f"{type(value['bytes']).__name__} (base64 text: decode it first)")  # fmt: skip
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, str) and value.lstrip().lower().startswith(("http://", "https://", "data:")):
        # Read as a relative path, it was "not found" at a mangled path (base/https:/host/x.png).
        at.fail(
            column, "wrong_type",
            f"image URLs and data URIs are not read ({value[:60]!r}): download the images and give their "
            "paths, or load the dataset with datasets' Image feature",
        )  # fmt: skip
    if isinstance(value, str) and value.lstrip().lower().startswith("file://"):
        # A local file as a URI (pathlib's as_uri): its path, not a name relative to the data folder.
        uri = urlparse(value.strip())
        if uri.netloc not in ("", "localhost"):  # file://x/y.png: "x" is a host, the path /y.png
            at.fail(column, "wrong_type", f"the file URI {value!r} names the host {uri.netloc!r}; a local "
                    "file's is file:///absolute/path (three slashes), or give the path itself")  # fmt: skip
        value = url2pathname(uri.path)
    if isinstance(value, str | os.PathLike):
        path = _resolve(value, base_dir)
        if check_files and not os.path.isfile(path):
            at.fail(column, "missing_image", f"image file not found: {path}")
        return path
    at.fail(
        column, "wrong_type", f"an image must be a path, a PIL image or {{'bytes', 'path'}}, got {value!r}"
    )


def image_refs(row: Mapping, at: RowAt, base_dir: Path | None, check_files: bool) -> list[ImageRef]:
    images, image = row.get("images"), row.get("image")
    if images is not None and image is not None:
        at.fail("images", "wrong_type", "row has both 'image' and 'images'; keep one")
    if image is not None:
        return [_image_ref(image, at, "image", base_dir, check_files)]
    if images is None:
        return []
    if not isinstance(images, Sequence) or isinstance(images, str | bytes):
        at.fail(
            "images",
            "wrong_type",
            f"'images' must be a list, got {type(images).__name__}; use 'image' for one",
        )
    return [_image_ref(v, at, "images", base_dir, check_files) for v in images]
