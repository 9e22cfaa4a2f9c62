"""``data.image_max_pixels`` / ``data.image_min_pixels``: each decoded image scaled into a pixel budget,
aspect kept, for every data shape, before the processor, HF generate or a vLLM server sees it."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from PIL import Image
from test_train import _run

from helpers import compose_train
from lightning_vlm.data import PreferenceDataModule, PromptDataModule, SFTDataModule, UnpairedDataModule
from lightning_vlm.data.image_budget import ImageBudget
from lightning_vlm.recurring import reset_recurring

IMG = {"type": "image"}
QUESTION = [IMG, {"type": "text", "text": "What colour is the shape?"}]


@pytest.mark.parametrize(
    ("budget", "size", "expected"),
    [
        # sqrt(1e6 / 12e6) = 0.288675: 4000 -> 1154.7, 3000 -> 866.03, rounded down (999,364 pixels)
        (ImageBudget(max_pixels=1_000_000), (4000, 3000), (1154, 866)),
        (ImageBudget(max_pixels=30_000), (400, 300), (200, 150)),  # a factor of exactly 1/2
        # sqrt(800 / 200) = 2 exactly; sqrt(1000 / 300) = 1.8257: 18.26 -> 19, 54.77 -> 55 (1045 pixels)
        (ImageBudget(min_pixels=800), (10, 20), (20, 40)),
        (ImageBudget(min_pixels=1000), (10, 30), (19, 55)),
        (ImageBudget(max_pixels=100, min_pixels=50), (10, 8), (10, 8)),  # within: as it is
        (ImageBudget(max_pixels=4), (1000, 1), (4, 1)),  # 0.06 of a pixel high is 1: the width gives way
        (ImageBudget(max_pixels=4), (1, 1000), (1, 4)),
        (ImageBudget(), (5000, 5000), (5000, 5000)),  # off by default
    ],
)
def test_the_size_an_image_is_scaled_to(budget, size, expected):
    assert budget.size_for(*size) == expected


def test_an_image_within_the_budget_is_not_resampled():
    image = Image.new("RGB", (10, 8), (1, 2, 3))
    assert ImageBudget(max_pixels=80, min_pixels=80).fit(image) is image


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_pixels": 0}, "data.image_max_pixels"),
        ({"max_pixels": 2.5e5}, "data.image_max_pixels"),
        ({"min_pixels": -1}, "data.image_min_pixels"),
        (
            {"max_pixels": 100, "min_pixels": 200},
            "data.image_min_pixels=200 is over data.image_max_pixels=100",
        ),
    ],
)
def test_bad_budgets_are_refused_naming_the_setting(kwargs, named, tmp_path):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        ImageBudget(**kwargs)
    # and from the DataModule, before any row is read
    keys = {f"image_{k}": v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SFTDataModule(train=str(tmp_path / "never_read.jsonl"), **keys)


def _rows(shape: str) -> list[dict]:
    image = {"images": ["big.png"], "solution": "red"}
    if shape == "sft":
        return [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "red"}],
                 **image}]  # fmt: skip
    prompt = [{"role": "user", "content": QUESTION}]
    if shape == "prompt":
        return [{"prompt": prompt, **image}]
    if shape == "preference":
        return [{"prompt": prompt, "chosen": "red", "rejected": "blue", **image}]
    return [{"prompt": prompt, "completion": "red", "label": True, **image}]


MODULES = {"sft": SFTDataModule, "prompt": PromptDataModule, "preference": PreferenceDataModule,
           "unpaired": UnpairedDataModule}  # fmt: skip


def _write(folder: Path, shape: str, size: tuple[int, int] = (400, 300)) -> Path:
    # The left half red, the right half blue: the scaled copy keeps where each colour is.
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[:, : size[0] // 2] = (255, 0, 0)
    pixels[:, size[0] // 2 :] = (0, 0, 255)
    Image.fromarray(pixels).save(folder / "big.png")
    path = folder / f"{shape}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(shape)) + "\n")
    return path


@pytest.mark.parametrize("shape", list(MODULES))
def test_every_data_shape_yields_its_images_scaled_into_the_budget(shape, tmp_path, caplog):
    reset_recurring()  # as each run does (training.build)
    dm = MODULES[shape](train=str(_write(tmp_path, shape)), image_max_pixels=30_000)
    dm.setup()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data.image_budget"):
        rows = [row for batch in dm.train_dataloader() for row in batch]
    for row in rows:
        (image,) = row["images"]
        assert image.size == (200, 150)
        pixels = np.asarray(image)
        assert (pixels[:, :90] == (255, 0, 0)).all() and (pixels[:, 110:] == (0, 0, 255)).all()
    warned = [r.getMessage() for r in caplog.records if "resized an image" in r.getMessage()]
    assert len(warned) == 1 and "(400x300 -> 200x150)" in warned[0], warned


def test_without_a_budget_images_stay_as_stored(tmp_path):
    dm = PromptDataModule(train=str(_write(tmp_path, "prompt")))
    dm.setup()
    (row,) = next(iter(dm.train_dataloader()))
    assert row["images"][0].size == (400, 300)


def test_a_small_image_is_scaled_up_to_the_minimum(tmp_path):
    dm = PromptDataModule(train=str(_write(tmp_path, "prompt", (20, 10))), image_min_pixels=800)
    dm.setup()
    (row,) = next(iter(dm.train_dataloader()))
    assert row["images"][0].size == (40, 20)  # sqrt(800 / 200) = 2


def test_the_budget_from_the_config_and_what_a_vllm_server_is_sent(tmp_path):
    from lightning_vlm.generation.vllm_server import image_url

    cfg = compose_train(
        ["method=grpo", f"data.train={_write(tmp_path, 'prompt')}", "data.image_max_pixels=30000"]
    )
    dm = instantiate(cfg.data, _convert_="all")
    assert dm.row_format.image_budget == ImageBudget(max_pixels=30_000)
    assert compose_train([]).data.image_max_pixels is None  # the documented default: off
    dm.setup()
    (row,) = next(iter(dm.train_dataloader()))
    sent = Image.open(io.BytesIO(base64.b64decode(image_url(row["images"][0]).split(",", 1)[1])))
    assert sent.size == (200, 150)
    assert np.array_equal(np.asarray(sent), np.asarray(row["images"][0]))  # the pixels the trainer has


@pytest.mark.slow
def test_train_py_trains_on_scaled_images(tmp_path):
    path = _write(tmp_path, "prompt", (448, 448))
    overrides = ["method=grpo", f"data.train={path}", "data.image_max_pixels=3136", "data.batch_size=1",
                 "trainer.max_steps=2", "trainer.limit_val_batches=0", "logger=none", "callbacks=none"]  # fmt: skip
    proc = _run(overrides, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "448x448 -> 56x56" in proc.stdout + proc.stderr  # the warning (Hydra logs to stdout)


def _photo(path: Path, size: tuple[int, int], orientation: int = 1) -> None:
    """A smooth JPEG (a gradient), optionally stored sideways with an EXIF orientation tag."""
    x = np.linspace(0, 255, size[0], dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, size[1], dtype=np.float32)[:, None, None]
    pixels = np.broadcast_to(np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], -1), (size[1], size[0], 3))
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=95, exif=exif)


# 1600x1200 decodes at 1/8 scale, 200x150 at once; 1000x750 at 1/4 (250x188), then resized to 200x150.
@pytest.mark.parametrize(("stored", "decoded"), [((1600, 1200), (200, 150)), ((1000, 750), (250, 188))])
def test_a_jpeg_decoded_at_a_reduced_scale_gets_the_size_and_pixels_of_a_full_decode(
    stored, decoded, tmp_path, caplog, monkeypatch
):
    from PIL.JpegImagePlugin import JpegImageFile

    from lightning_vlm.data import open_image

    drafts = []
    draft = JpegImageFile.draft

    def spy(self, mode, size):
        result = draft(self, mode, size)
        drafts.append(self.size)  # the size the decoder will produce
        return result

    monkeypatch.setattr(JpegImageFile, "draft", spy)
    path = tmp_path / "photo.jpg"
    _photo(path, stored)
    budget = ImageBudget(max_pixels=30_000)
    reset_recurring()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.data.image_budget"):
        drafted = open_image(str(path), budget=budget)
        (warning,) = caplog.records  # said also where the draft alone resized it
    assert drafts == [decoded]
    full = budget.fit(open_image(str(path)))
    assert drafts == [decoded]  # no draft without a budget
    assert drafted.size == full.size == (200, 150)
    # the same picture: a gradient's pixels within a few levels (JPEG's DCT scaling vs bicubic alone)
    assert np.abs(np.asarray(drafted, np.float32) - np.asarray(full, np.float32)).mean() < 2.0
    assert f"({stored[0]}x{stored[1]} -> 200x150)" in warning.getMessage()  # the stored size, not the draft's


@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 7, 8])  # 5-8 turn it a quarter: width and height swap
def test_a_photo_with_an_exif_orientation_is_scaled_upright(orientation, tmp_path):
    from lightning_vlm.data import open_image

    path = tmp_path / "sideways.jpg"
    _photo(path, (1600, 1200), orientation)
    budget = ImageBudget(max_pixels=30_000)
    upright = open_image(str(path))
    turned = orientation >= 5
    assert upright.size == ((1200, 1600) if turned else (1600, 1200))
    scaled = open_image(str(path), budget=budget)
    assert scaled.size == ((150, 200) if turned else (200, 150))
    # the picture turned the same way as the full-size decode (a gradient: a wrong turn is far off)
    assert np.abs(np.asarray(scaled, np.float32) - np.asarray(budget.fit(upright), np.float32)).mean() < 2.0


def test_images_given_as_bytes_or_pil_images_are_scaled_too(tmp_path):
    from lightning_vlm.data import open_image

    path = tmp_path / "photo.jpg"
    _photo(path, (1600, 1200))
    budget = ImageBudget(max_pixels=30_000)
    assert open_image(path.read_bytes(), budget=budget).size == (200, 150)
    with Image.open(path) as image:
        assert open_image(image, budget=budget).size == (200, 150)
        assert image.size == (1600, 1200)  # the caller's image is left as it is


def test_the_processor_gets_the_scaled_image_and_its_fewer_tokens(tiny_path, tmp_path):
    # Qwen2.5-VL's tiny processor takes a 448x448 image down to 112x112 (16 tokens); the budget makes it
    # 56x56 (4 tokens) before the processor sees it.
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_path("qwen2_5_vl"))
    path = _write(tmp_path, "prompt", (448, 448))
    tokens = {}
    for budget in (None, 3136):
        dm = PromptDataModule(train=str(path), image_max_pixels=budget)
        dm.setup()
        (row,) = next(iter(dm.train_dataloader()))
        grid = processor.image_processor(images=row["images"], return_tensors="pt")["image_grid_thw"]
        tokens[budget] = int(grid.prod()) // 4
    assert tokens == {None: 16, 3136: 4}


@pytest.mark.parametrize(("kinds", "image_size"), [(["grounding"], 56), (["size", "color"], 112)])
def test_synthetic_answers_in_pixels_are_not_scaled_away(kinds, image_size):
    synthetic = {"kinds": kinds, "image_size": image_size}
    dm = PromptDataModule(synthetic=synthetic, image_max_pixels=image_size * image_size - 1)
    with pytest.raises(
        ValueError, match=r"data\.image_max_pixels.*\(\d+x\d+ -> \d+x\d+\).*data\.synthetic\.image_size"
    ):
        dm.setup()
    # a budget the images already fit, and kinds answered in words, are left alone
    PromptDataModule(synthetic=synthetic, image_max_pixels=image_size * image_size).setup()
    PromptDataModule(synthetic={"kinds": ["color"]}, image_max_pixels=1000).setup()


def test_train_py_refuses_such_budgets_before_the_model_loads():
    from lightning_vlm.settings_check import check_settings

    with pytest.raises(ValueError, match=r"synthetic \['grounding'\] images \(56x56 -> 31x31\)"):
        check_settings(compose_train(["experiment=grpo_grounding", "data.image_max_pixels=1000"]))
    with pytest.raises(ValueError, match=r"data\.image_max_pixels must be a whole number > 0"):
        check_settings(compose_train(["data.image_max_pixels=0"]))
    check_settings(compose_train(["experiment=grpo_grounding", "data.image_max_pixels=3136"]))  # 56x56 fits
    check_settings(compose_train(["data.image_max_pixels=1000"]))  # colour answers are words
