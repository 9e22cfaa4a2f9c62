"""The data bad-input matrix: every kind of bad data a user can hand us, and what they get back.

Each error case asserts the exception type and that its message names where the problem is: the
file, the row and column, the line / byte offset, or the setting. Each skip case asserts the row is
counted and logged. The image cases used to be silently wrong (16-bit images clipped to white,
transparency turned black) and assert the pixels instead.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pytest
from hydra.utils import instantiate
from PIL import Image

from helpers import ROOT, compose_train
from lightning_vlm.data import NoRowsError, RowError, SFTDataModule, SourceError, open_image

IMG = {"type": "image"}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def sft_row(image: str = "red.png", answer: str = "red") -> dict:
    """A good SFT row: one image, a question, an answer."""
    user = {"role": "user", "content": [IMG, {"type": "text", "text": "Color?"}]}
    return {"messages": [user, {"role": "assistant", "content": answer}], "images": [image]}


def write_rows(folder: Path, rows: list[dict], name: str = "data.jsonl") -> Path:
    """Rows as a JSON Lines file next to a red.png and a corrupt bad.png."""
    Image.new("RGB", (8, 8), (255, 0, 0)).save(folder / "red.png")
    (folder / "bad.png").write_bytes(b"not a png")
    path = folder / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def broken(change: Callable[[dict], None], rows: tuple[int, ...] = (1,), **kwargs) -> Callable[[Path], dict]:
    """A case: three good rows with ``rows`` changed in place; returns the DataModule's kwargs."""

    def make(folder: Path) -> dict:
        data = [sft_row() for _ in range(3)]
        for i in rows:
            change(data[i])
        return {"train": str(write_rows(folder, data)), **kwargs}

    return make


def raw_file(content: bytes, name: str = "data.jsonl") -> Callable[[Path], dict]:
    """A case: a data file with exactly these bytes."""

    def make(folder: Path) -> dict:
        (folder / name).write_bytes(content)
        return {"train": str(folder / name)}

    return make


def no_answer(row: dict) -> None:
    row["messages"] = row["messages"][:1]


def two_image_blocks(row: dict) -> None:
    row["messages"][0]["content"] = [IMG, IMG, {"type": "text", "text": "Two?"}]


def skipped_val(folder: Path) -> dict:
    val = write_rows(folder, [{**sft_row(), "messages": sft_row()["messages"][:1]}] * 2, "val.jsonl")
    return {"train": str(write_rows(folder, [sft_row()])), "val": str(val), "on_bad_row": "skip"}


def batch_of_corrupt_images(folder: Path) -> dict:
    # Rows 0-1 decode, rows 2-3 do not: with batch_size 2 the second batch is empty after skipping.
    rows = [sft_row(), sft_row(), sft_row("bad.png"), sft_row("bad.png")]
    return {"train": str(write_rows(folder, rows)), "on_bad_row": "skip", "batch_size": 2, "shuffle": False}


# case: (the DataModule kwargs it makes in a folder, the error, what the message names; {dir}: the folder)
Case = tuple[Callable[[Path], dict], type[Exception], tuple[str, ...]]


BAD_LINE = b'{"messages": [], "images": []}\n\n{"messages": [oops], "images": []}\n'
LATIN1 = json.dumps(sft_row()).encode() + b'\n{"messages": "caf\xe9"}\n'
ROW = "{dir}/data.jsonl, row 1, column"  # {dir}: the test's folder
# fmt: off
ERRORS: dict[str, Case] = {  # a table, so kept as laid out
    # Clear before this change, kept so the matrix is complete.
    "missing_column": (broken(lambda r: r.pop("messages")), RowError,
                       (f"{ROW} 'messages'", "missing_column", "(columns: ['images'])")),
    "missing_image_file": (broken(lambda r: r.update(images=["nope.png"])), RowError,
                           (f"{ROW} 'images'", "missing_image", "nope.png")),
    "image_url": (broken(lambda r: r.update(images=["https://example.com/x.png"])), RowError,
                  (f"{ROW} 'images'", "wrong_type", "image URLs and data URIs are not read", "example.com")),
    "unreadable_image": (broken(lambda r: r.update(images=["bad.png"])), RowError,
                         (f"{ROW} 'images'", "corrupt_image", "bad.png")),
    "image_count_mismatch": (broken(two_image_blocks), RowError,
                             (f"{ROW} 'messages'", "image_count_mismatch")),
    "missing_data_file": (lambda d: {"train": str(d / "gone.jsonl")}, SourceError, ("{dir}/gone.jsonl",)),
    # SFT rows that would train on nothing.
    "sft_no_assistant_turn": (broken(no_answer), RowError,
                              (f"{ROW} 'messages'", "no_answer", "no assistant turn")),
    "sft_empty_assistant_turn": (broken(lambda r: r["messages"][1].update(content="  ")), RowError,
                                 (f"{ROW} 'messages'", "no_answer", "empty assistant")),
    "sft_empty_completion": (broken(lambda r: r.update(messages=None, prompt="Q", completion="")), RowError,
                             (f"{ROW} 'completion'", "no_answer")),
    # Bad data files.
    "empty_jsonl": (raw_file(b""), SourceError, ("{dir}/data.jsonl", "empty (0 bytes)")),
    "blank_jsonl": (raw_file(b"\n \n"), SourceError, ("{dir}/data.jsonl", "empty (only whitespace)")),
    "invalid_json_line": (raw_file(BAD_LINE), SourceError,
                          ("{dir}/data.jsonl", "line 3, column 15: invalid JSON", "oops")),
    "json_line_not_an_object": (raw_file(b'{"messages": []}\n[1, 2]\n'), SourceError,
                                ("{dir}/data.jsonl", "line 2 is a JSON list")),
    "non_utf8_bytes": (raw_file(LATIN1), SourceError,
                       ("{dir}/data.jsonl", f"byte offset {len(LATIN1) - 4} (line 2,", "\\xe9")),
    "invalid_json_document": (raw_file(b'[\n  {"messages": []},\n  {"messages": ]\n]', "data.json"),
                              SourceError, ("{dir}/data.json", "line 3, column 16: invalid JSON")),
    "empty_json_list": (raw_file(b"[]", "data.json"), SourceError, ("{dir}/data.json", "no rows")),
    "invalid_json_line_gzipped": (raw_file(gzip.compress(BAD_LINE), "data.jsonl.gz"), SourceError,
                                  ("{dir}/data.jsonl.gz", "line 3, column 15: invalid JSON", "oops")),
    "empty_gzip": (raw_file(gzip.compress(b""), "data.jsonl.gz"), SourceError,
                   ("{dir}/data.jsonl.gz", "empty (0 bytes once decompressed)")),
    "corrupt_gzip": (raw_file(b"\x1f\x8b not really", "data.jsonl.gz"), SourceError,
                     ("{dir}/data.jsonl.gz", "not a readable .gz archive")),
    "csv_file": (raw_file(b"a,b\n1,2\n", "data.v2.csv"), SourceError,
                 ("{dir}/data.v2.csv", "unsupported file type '.csv'", ".jsonl")),
    "compressed_parquet": (raw_file(b"PAR1", "data.parquet.gz"), SourceError,
                           ("{dir}/data.parquet.gz", "unsupported file type '.parquet.gz'", "may be compressed")),
    "corrupt_parquet": (raw_file(b"PAR1 not really", "data.parquet"), SourceError,
                        ("{dir}/data.parquet", "could not be read as parquet")),
    # Nothing left after skipping.
    "every_train_row_skipped": (broken(no_answer, (0, 1, 2), on_bad_row="skip"), NoRowsError,
                                ("{dir}/data.jsonl", "data.on_bad_row=skip", "every one of its 3 rows",
                                 "3 no_answer", "data.train")),
    "every_val_row_skipped": (skipped_val, NoRowsError,
                              ("{dir}/val.jsonl", "data.on_bad_row=skip", "2 no_answer", "data.val")),
    "batch_empty_after_load_skips": (batch_of_corrupt_images, NoRowsError,
                                     ("{dir}/data.jsonl", "data.on_bad_row=skip", "rows [2, 3]",
                                      "2 corrupt_image", "empty batch")),
    # Rows that loaded and trained wrongly (helper review): ShareGPT's roles (the "gpt" answer was never
    # trained on), an image's bytes as base64 text (read as a path: "file not found")
    "sharegpt_roles": (broken(lambda r: r["messages"][1].update(role="gpt")), RowError,
                       (f"{ROW} 'messages'", "message 1 has role 'gpt'", "'assistant'")),
    # A model's own image token, as an export formatted for it writes (the processor raised StopIteration,
    # which Lightning took for the end of every epoch: a run hung, or skipped the rest of each epoch)
    "qwen_image_token": (broken(lambda r: r["messages"][0]["content"].__setitem__(1, {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>Color?"})),
                         RowError, (f"{ROW} 'messages'", "holds the model image token '<|image_pad|>'", "'<image>'")),
    "model_token_in_template": (lambda d: {"prompt_template": "<|image_pad|>{question}", "answer_template": "{answer}"},
                                ValueError, ("data.prompt_template holds the model image token '<|image_pad|>'",)),
    # A chat template's turn marker in the text (data exported already templated): the tokenizer reads it as
    # that control token, so SFT's labels stopped at an answer's "<|im_end|>" and the rest was never trained
    "turn_token_in_answer": (broken(lambda r: r["messages"][1].update(content="red<|im_end|>\n<|im_start|>user\nmore")),
                             RowError, (f"{ROW} 'messages'", "holds the chat control token '<|im_end|>'")),
    "turn_token_in_prompt": (broken(lambda r: r["messages"][0]["content"].__setitem__(1, {"type": "text", "text": "<start_of_turn>user Color?"})),
                             RowError, (f"{ROW} 'messages'", "'<start_of_turn>'")),
    "turn_token_in_system_prompt": (lambda d: {"system_prompt": "Be brief.<|im_end|>"}, ValueError,
                                    ("data.system_prompt holds the chat control token '<|im_end|>'",)),
    "turn_token_in_template": (lambda d: {"prompt_template": "{question}<end_of_utterance>", "answer_template": "{answer}"},
                               ValueError, ("data.prompt_template holds the chat control token '<end_of_utterance>'",)),
    # "<image>" (ms-swift, LLaVA) places an image: one more than the row has is counted
    "extra_image_placeholder": (broken(lambda r: r["messages"][0]["content"].__setitem__(1, {"type": "text", "text": "<image>Color?"})),
                                RowError, (f"{ROW} 'messages'", "block(s) in the messages but 1 image(s)")),
    "image_bytes_as_text": (broken(lambda r: r.update(images=[{"bytes": "iVBORw0KGgo="}])), RowError,
                            (f"{ROW} 'images'", "'bytes' must be the encoded file's bytes", "base64")),
    # A bad setting.
    "bad_alpha_background": (lambda d: {"alpha_background": [1, 2]}, ValueError,
                             ("data.alpha_background", "[1, 2]")),
    "column_map_onto_one": (lambda d: {"column_map": {"question": "prompt", "answer": "prompt"}}, ValueError,
                            ("data.column_map maps several columns onto one", "'prompt': ['answer', 'question']")),
    "column_map_not_a_mapping": (lambda d: {"column_map": ["question"]}, ValueError, ("data.column_map must map",)),
    "max_samples_zero": (lambda d: {"max_samples": 0}, ValueError, ("data.max_samples must be a whole number > 0",)),
    "max_val_samples_negative": (lambda d: {"max_val_samples": -1}, ValueError, ("data.max_val_samples", "-1")),
}
# fmt: on


def every_batch(dm: SFTDataModule) -> None:
    """Setup, then every train and val batch: corrupt images only show when decoded."""
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        for _ in loader:
            pass


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_naming_where(case, tmp_path):
    make, error, names = ERRORS[case]
    with pytest.raises(error) as info:
        every_batch(SFTDataModule(**make(tmp_path)))
    message = str(info.value)
    for name in names:
        assert name.format(dir=tmp_path) in message, message


SKIPS: dict[str, tuple[Callable[[dict], None], str, str]] = {
    # case: (how row 1 is broken, the reason counted, what the log names)
    "missing_column": (lambda r: r.pop("messages"), "missing_column", f"{ROW} 'messages'"),
    "sft_no_assistant_turn": (no_answer, "no_answer", f"{ROW} 'messages'"),
    "unreadable_image": (lambda r: r.update(images=["bad.png"]), "corrupt_image", f"{ROW} 'images'"),
}


@pytest.mark.parametrize("case", list(SKIPS))
def test_skipped_rows_are_counted_and_logged(case, tmp_path, caplog):
    change, reason, where = SKIPS[case]
    dm = SFTDataModule(**broken(change, on_bad_row="skip", shuffle=False)(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        dm.setup()
        rows = [row for batch in dm.train_dataloader() for row in batch]
    assert len(rows) == 2 and dm.skipped == {reason: 1}
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "lightning_vlm.data")
    assert where.format(dir=tmp_path) in logged and reason in logged
    if reason != "corrupt_image":  # the setup scan's one summary line per source
        assert "skipped 1 of 3 rows" in logged


def gradient(mode: str, low: float, high: float) -> Image.Image:
    """A 4x256 horizontal gradient from ``low`` to ``high`` in a single-channel PIL mode."""
    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    return Image.fromarray(np.tile(np.linspace(low, high, 256), (4, 1)).astype(dtype))


def decoded(image: Image.Image, tmp_path: Path, suffix: str = ".png", **kwargs) -> np.ndarray:
    """The RGB pixels a training batch gets for ``image``, saved as a file next to a JSONL row."""
    image.save(tmp_path / f"image{suffix}")
    rows = [sft_row(f"image{suffix}")]
    dm = SFTDataModule(train=str(write_rows(tmp_path, rows)), **kwargs)
    dm.setup()
    (row,) = next(iter(dm.train_dataloader()))
    assert row["images"][0].mode == "RGB"
    return np.asarray(row["images"][0])


def keeps_gradient(pixels: np.ndarray) -> None:
    grey = pixels[0, :, 0].astype(int)
    assert (pixels == 255).mean() < 0.01, "clipped to white"
    assert grey[0] == 0 and grey[-1] == 255 and np.all(np.diff(grey) >= 0) and len(set(grey)) > 200


def transparent(mode: str) -> Image.Image:
    if mode == "P":  # a palette image whose colour 0 (black) is the transparent one, as in GIFs
        image = Image.new("P", (8, 8), 0)
        image.putpalette([0, 0, 0, 255, 0, 0])
        image.info["transparency"] = 0
        return image
    return Image.new(mode, (8, 8), (0,) * len(mode))


IMAGES: dict[str, Callable[[Path], None]] = {
    "png_16bit_grey": lambda d: keeps_gradient(decoded(gradient("I;16", 0, 65535), d)),
    "tiff_32bit_int_in_16bit_range": lambda d: keeps_gradient(decoded(gradient("I", 0, 65535), d, ".tif")),
    "tiff_32bit_int_beyond_16bit": lambda d: keeps_gradient(decoded(gradient("I", -7, 2**20), d, ".tif")),
    "tiff_float_0_to_1": lambda d: keeps_gradient(decoded(gradient("F", 0.0, 1.0), d, ".tif")),
    "tiff_float_any_range": lambda d: keeps_gradient(decoded(gradient("F", -5.0, 5.0), d, ".tif")),
    "rgba_transparent_is_white": lambda d: check(decoded(transparent("RGBA"), d), (255, 255, 255)),
    "la_transparent_is_white": lambda d: check(decoded(transparent("LA"), d), (255, 255, 255)),
    "palette_transparency_is_white": lambda d: check(decoded(transparent("P"), d), (255, 255, 255)),
    "rgba_half_alpha_blends": lambda d: check(
        np.asarray(open_image(Image.new("RGBA", (8, 8), (255, 0, 0, 128)))), (255, 127, 127)
    ),
    "alpha_background_setting": lambda d: check(
        decoded(transparent("RGBA"), d, alpha_background=[0, 0, 255]), (0, 0, 255)
    ),
    "served_image_alpha_is_white": lambda d: check(np.asarray(served(transparent("RGBA"))), (255, 255, 255)),
}


def check(pixels: np.ndarray, rgb: tuple[int, int, int]) -> None:
    assert pixels.shape[-1] == 3 and (pixels == rgb).all(axis=-1).all(), pixels[0, 0]


def served(image: Image.Image) -> Image.Image:
    """``image`` as a vLLM server receives it: a row's image (``to_rgb``) in the client's data URL."""
    from lightning_vlm.data.images import to_rgb
    from lightning_vlm.generation.vllm_server import image_url

    url = image_url(to_rgb(image))
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


@pytest.mark.parametrize("case", list(IMAGES))
def test_images_decode_to_faithful_rgb(case, tmp_path):
    IMAGES[case](tmp_path)


def test_alpha_background_from_the_config(tmp_path):
    cfg = compose_train([f"data.train={write_rows(tmp_path, [sft_row()])}", "data.alpha_background=[0,0,0]"])
    dm = instantiate(cfg.data, _convert_="all")
    assert dm.row_format.alpha_background == (0, 0, 0)
    assert compose_train([]).data.alpha_background == [255, 255, 255]  # the documented default


@pytest.mark.slow
def test_train_py_exits_non_zero_naming_the_bad_line(tmp_path):
    # The whole path a user takes: the message reaches the console before any training step.
    spec = raw_file(BAD_LINE)(tmp_path)["train"]
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"data.train={spec}", "logger=csv", "trainer.max_steps=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert f"SourceError: {spec}: line 3, column 15: invalid JSON" in proc.stderr, proc.stderr[-3000:]


def test_exif_orientation_is_applied_as_datasets_does(tmp_path):
    # A phone photo: stored 40x20 with EXIF Orientation=6 ("rotate 90° clockwise to view"), so it is
    # seen, and decoded by datasets and transformers' load_image, as 20x40.
    photo = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = photo.getexif()
    exif[0x0112] = 6
    photo.save(tmp_path / "photo.jpg", exif=exif.tobytes())
    dm = SFTDataModule(train=str(write_rows(tmp_path, [sft_row("photo.jpg")])))
    dm.setup()
    assert dm.train_dataset[0]["images"][0].size == (20, 40)
    answer = {"role": "assistant", "content": [{"type": "text", "text": "red"}]}  # Arrow: one type
    row = {"messages": [sft_row()["messages"][0], answer], "images": [str(tmp_path / "photo.jpg")]}
    stored = datasets.Dataset.from_list([row])
    stored.cast_column("images", datasets.List(datasets.Image())).save_to_disk(str(tmp_path / "saved"))
    dm = SFTDataModule(train=str(tmp_path / "saved"))
    dm.setup()
    assert dm.train_dataset[0]["images"][0].size == (20, 40)
    # A PIL image handed over in a row is turned upright too, as transformers' load_image turns one,
    # and only once: the upright image no longer carries the tag.
    from lightning_vlm.data.images import open_image

    with Image.open(tmp_path / "photo.jpg") as opened:
        upright = open_image(opened)
    assert upright.size == (20, 40) and open_image(upright).size == (20, 40)


def test_a_decompression_bomb_is_a_corrupt_image_naming_its_row(tmp_path, monkeypatch, caplog):
    # PIL refuses images over 2 * MAX_IMAGE_PIXELS (179 Mpixel) with an error that is not an OSError;
    # a lowered limit stands in for a huge image.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    Image.new("RGB", (100, 100)).save(tmp_path / "huge.png")
    make = broken(lambda r: r.update(images=["huge.png"]))
    with pytest.raises(RowError, match=r"data.jsonl, row 1, column 'images'.*huge.png.*corrupt_image"):
        every_batch(SFTDataModule(**make(tmp_path)))
    dm = SFTDataModule(**make(tmp_path), on_bad_row="skip", shuffle=False)
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data"):
        dm.setup()
        rows = [row for batch in dm.train_dataloader() for row in batch]
    assert len(rows) == 2 and dm.skipped == {"corrupt_image": 1}
    assert "row 1, column 'images'" in caplog.text


def test_premultiplied_la_is_composited_like_la():
    from lightning_vlm.data.images import to_rgb

    check(np.asarray(to_rgb(Image.new("La", (8, 8), (0, 0)))), (255, 255, 255))
    # premultiplied grey 100 at alpha 128 is grey 199 (PIL's un-premultiply), half over white
    check(np.asarray(to_rgb(Image.new("La", (8, 8), (100, 128)))), (227, 227, 227))
    assert to_rgb(Image.new("La", (8, 8), (100, 128))) == to_rgb(Image.new("LA", (8, 8), (199, 128)))
