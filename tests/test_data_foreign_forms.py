"""Rows in the forms other libraries write: ms-swift's and LLaVA's ``<image>`` placeholders, LLaVA-Instruct's
ShareGPT conversations, ms-swift's GRPO prompts as ``messages``, and images under LLaVA's ``image_folder``."""

from __future__ import annotations

import json

import datasets
import pytest
from PIL import Image

from lightning_vlm.data import RowError, SFTDataModule, normalize_row

IMG = {"type": "image"}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


@pytest.fixture
def pictures(tmp_path):
    """A folder with img/red.png and img/blue.png."""
    (tmp_path / "img").mkdir()
    for name, color in (("red.png", (255, 0, 0)), ("blue.png", (0, 0, 255))):
        Image.new("RGB", (8, 8), color).save(tmp_path / "img" / name)
    return tmp_path


def test_image_placeholders_in_text_become_image_blocks_where_written(pictures):
    folder = pictures
    # ms-swift's and LLaVA's "<image>" (refused before: data in those formats needed a conversion script)
    swift = {"messages": [{"role": "user", "content": "<image>What is it?<image>And this?"},
                          {"role": "assistant", "content": "Two shapes."}],
             "images": ["img/red.png", "img/blue.png"]}  # fmt: skip
    out = normalize_row(swift, "sft", base_dir=folder)
    assert out["messages"][0]["content"] == [IMG, text("What is it?"), IMG, text("And this?")]
    llava = {"prompt": "<image>\nColour?", "completion": "red", "images": ["img/red.png"]}
    assert normalize_row(llava, "sft", base_dir=folder)["messages"][0]["content"] == [IMG, text("\nColour?")]
    typed = [{"type": "text", "text": "Compare <image> with"}, {"type": "image"}]
    out = normalize_row({"prompt": [{"role": "user", "content": typed}], "images": ["img/red.png"] * 2}, "prompt",
                        base_dir=folder)  # fmt: skip
    assert out["prompt"][0]["content"] == [text("Compare "), IMG, text(" with"), IMG]
    # ms-swift's GRPO rows hold the prompt as `messages` ("missing required column 'prompt'" before)
    grpo = {
        "messages": [{"role": "user", "content": "<image>Colour?"}],
        "solution": "red",
        "images": ["img/red.png"],
    }
    out = normalize_row(grpo, "prompt", base_dir=folder)
    assert out["prompt"] == [{"role": "user", "content": [IMG, text("Colour?")]}] and "messages" not in out
    assert out["solution"] == "red"
    # its last assistant answer is dropped, as ms-swift does: the policy must not see what it is rewarded for
    answered = {**grpo, "messages": [*grpo["messages"], {"role": "assistant", "content": "red"}]}
    assert normalize_row(answered, "prompt", base_dir=folder)["prompt"] == out["prompt"]
    # LLaVA-Instruct's ShareGPT rows ("message 0 has no string 'role'" before)
    llava = {"id": "000001", "image": "img/red.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Red."}]}  # fmt: skip
    out = normalize_row(llava, "sft", base_dir=folder)
    assert out["messages"] == [{"role": "user", "content": [IMG, text("\nWhat colour?")]},
                               {"role": "assistant", "content": [text("Red.")]}]  # fmt: skip
    assert out["images"] == [str(folder / "img" / "red.png")] and out["id"] == "000001"
    with pytest.raises(RowError, match=r"message 1 has role 'bing'"):
        normalize_row(
            {**llava, "conversations": [llava["conversations"][0], {"from": "bing", "value": "x"}]},
            "sft",
            base_dir=folder,
        )


def test_image_dir_is_where_relative_image_paths_start(pictures, tmp_path, monkeypatch):
    # LLaVA-Instruct's JSON names images relative to an image folder (its image_folder), not to itself
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = pictures
    chat = [{"role": "user", "content": [IMG, text("Colour?")]}, {"role": "assistant", "content": "red"}]
    rows = [{"messages": chat, "images": ["red.png"]}]
    data = tmp_path / "json" / "data.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(RowError, match=r"image file not found: .*json/red\.png"):
        SFTDataModule(train=str(data)).setup()
    with pytest.raises(FileNotFoundError, match=r"data.image_dir='.*nope': no such folder"):
        SFTDataModule(train=str(data), image_dir=str(folder / "nope"))
    dm = SFTDataModule(train=str(data), image_dir=str(folder / "img"))
    dm.setup()
    assert dm.train_dataset[0]["images"][0].size == Image.open(folder / "img" / "red.png").size


def test_a_file_uri_is_the_local_path_it_names(pictures):
    folder = pictures
    # file:// URIs are local paths (they were joined onto the data folder: "<folder>/file:/...", not found)
    uri = (folder / "img" / "red.png").as_uri()
    out = normalize_row(
        {"prompt": "Q", "completion": "A", "image": uri}, "sft", base_dir=folder / "elsewhere"
    )
    assert out["images"] == [str(folder / "img" / "red.png")]
    with pytest.raises(RowError, match=r"names the host 'img'.*three slashes"):
        normalize_row(
            {"prompt": "Q", "completion": "A", "image": "file://img/red.png"}, "sft", base_dir=folder
        )
