"""What ``data.image_max_pixels`` saves per photo: decoding a row's image, the PNG a vLLM server is sent,
and Qwen2.5-VL's image processing, with and without the budget.

Usage: ``python benchmarks/image_budget.py [--repeats 5] [--out benchmarks/results/image_budget.json]``.
A 12-megapixel photo-like JPEG (4000x3000: smooth shading plus sensor noise, quality 90) is loaded the way
DataModules load a row (``load_row``), turned into the data URL the server client sends (``image_url``) and
processed by a Qwen2.5-VL image processor with this repository's hub settings (``max_pixels`` 401408, 512
tokens). The budget is the processor's own limit, so the model gets as many tokens either way; the
difference is what the trainer decodes (with a budget a JPEG is decoded at a reduced scale), holds and
sends. The same passes also save the image as a PNG at PIL's default level (6), against the client's level
1. Medians (and min / max) of ``--repeats`` interleaved runs, one process.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vlm.data.image_budget import ImageBudget  # noqa: E402
from lightning_vlm.data.images import load_row  # noqa: E402
from lightning_vlm.generation.vllm_server import image_url  # noqa: E402

QWEN_MAX_PIXELS = 401408  # conf/model/qwen2_5_vl.yaml


def photo(path: Path, size: tuple[int, int] = (4000, 3000)) -> None:
    """A JPEG that compresses like a photo: smooth colour fields with per-pixel noise."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0 : size[1], 0 : size[0]].astype(np.float32)
    base = np.stack(
        [128 + 100 * np.sin(x / 500), 128 + 100 * np.cos(y / 400), 128 + 60 * np.sin((x + y) / 700)], -1
    )
    pixels = np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def one_pass(path: Path, budget: ImageBudget | None, processor) -> dict:
    row = {"prompt": "?", "images": [str(path)]}
    start = time.perf_counter()
    (image,) = load_row(row, "prompt", budget=budget)["images"]
    loaded = time.perf_counter()
    url = image_url(image)
    sent = time.perf_counter()
    grid = processor(images=[image], return_tensors="pt")["image_grid_thw"]
    processed = time.perf_counter()
    default = io.BytesIO()  # PIL's own PNG level (6), against the client's level 1, in the same pass
    image.save(default, format="PNG")
    saved = time.perf_counter()
    return {
        "load_s": loaded - start,
        "png_url_s": sent - loaded,
        "processor_s": processed - sent,
        "url_mib": len(url) / 2**20,
        "png_pil_default_level_s": saved - processed,
        "png_pil_default_level_mib": len(default.getvalue()) / 2**20,
        "held_mpixels": image.size[0] * image.size[1] / 1e6,
        "image_tokens": int(grid.prod()) // 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/image_budget.json")
    args = parser.parse_args()
    import torch
    from transformers import Qwen2VLImageProcessor

    torch.set_num_threads(2)
    processor = Qwen2VLImageProcessor(
        min_pixels=3136, max_pixels=QWEN_MAX_PIXELS, patch_size=14, merge_size=2
    )
    budgets = {"as_stored": None, f"image_max_pixels={QWEN_MAX_PIXELS}": ImageBudget(QWEN_MAX_PIXELS)}
    runs: dict[str, list[dict]] = {name: [] for name in budgets}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "photo.jpg"
        photo(path)
        for _ in range(args.repeats):  # interleaved: machine noise hits both alike
            for name, budget in budgets.items():
                runs[name].append(one_pass(path, budget, processor))
        jpeg_mib = path.stat().st_size / 2**20
    results = {
        name: {key: round(statistics.median(r[key] for r in passes), 4) for key in passes[0]}
        for name, passes in runs.items()
    }
    spread = {
        name: {key: [round(min(r[key] for r in passes), 4), round(max(r[key] for r in passes), 4)]
               for key in ("load_s", "png_url_s", "processor_s", "png_pil_default_level_s")}
        for name, passes in runs.items()
    }  # fmt: skip
    plain, budgeted = results.values()
    report = {
        "what": "one 4000x3000 photo-like JPEG: load_row, the server's PNG data URL, Qwen2.5-VL image processing",
        "jpeg_mib": round(jpeg_mib, 2),
        "repeats": args.repeats,
        "device": f"cpu ({torch.get_num_threads()} threads), {platform.processor() or platform.machine()}",
        "medians": results,
        "min_max": spread,
        "ratios_as_stored_over_budget": {
            key: round(plain[key] / budgeted[key], 2)
            for key in ("load_s", "png_url_s", "processor_s", "url_mib")
        },
        # the client's PNG level (1) against PIL's default (6), from the same passes (base64 included in
        # png_url_s, not in the default level's time: the ratio understates level 1's gain slightly)
        "png_default_level_over_client_level_s": {
            name: round(r["png_pil_default_level_s"] / r["png_url_s"], 2) for name, r in results.items()
        },
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
