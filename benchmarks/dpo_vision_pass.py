"""DPO step (forward + backward over chosen and rejected): one vision pass per pair vs the naive forward.

Usage: ``python benchmarks/dpo_vision_pass.py [--repeats 7] [--out benchmarks/results/dpo_vision_pass.json]``.
Measures, in one run and interleaved (so machine noise hits both paths alike), the median step time
and the peak memory of both paths for a few batch sizes on two models: the tiny zoo Qwen2.5-VL
(112 px images, 16 image tokens) and the same recipe with a larger vision tower (depth 8, width
256) and 224 px images (64 image tokens), where the vision tower is a real share of the step.
Peak memory as ``_peak.timed_peak`` measures it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from _peak import add_medians, mmap_large_blocks, timed_peak, write_report

mmap_large_blocks()
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vlm.data.synthetic import synthetic_rows  # noqa: E402
from lightning_vlm.methods.preference_batch import encode_pairs  # noqa: E402
from lightning_vlm.models.tiny import tiny_vlm_path  # noqa: E402
from lightning_vlm.models.vision_cache import IMAGE_GROUPS_KEY  # noqa: E402
from lightning_vlm.models.vlm import VLM  # noqa: E402


def large_vision_model(folder: Path) -> Path:
    """The tiny Qwen2.5-VL recipe with a 8-layer, 256-wide vision tower (random weights), saved to ``folder``."""
    base = tiny_vlm_path("qwen2_5_vl")
    config = AutoConfig.from_pretrained(base)
    config.vision_config.update({"depth": 8, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4,
                                 "fullatt_block_indexes": [3, 7]})  # fmt: skip
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    AutoProcessor.from_pretrained(base).save_pretrained(folder)
    return folder


def measure(vlm: VLM, inputs: dict, mask: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds and peak extra bytes of one forward + backward."""
    vlm.model.zero_grad(set_to_none=True)
    return timed_peak(lambda: vlm.token_logps(inputs, mask)[0].sum().backward(), device)


def run(name: str, vlm: VLM, pairs: list[int], repeats: int, device: torch.device) -> list[dict]:
    """Both paths at each number of pairs; medians and ratios."""
    vlm.model.to(device).train()
    results = []
    for num_pairs in pairs:
        batch = encode_pairs(vlm, synthetic_rows("preference", num_pairs, seed=0))
        shared = {k: v.to(device) for k, v in batch.inputs.items()}
        naive = {k: v for k, v in shared.items() if k != IMAGE_GROUPS_KEY}
        mask = batch.completion_mask.to(device)
        samples: dict[str, list[tuple[float, float]]] = {"one_pass": [], "naive": []}
        for _ in range(2):  # warm-up (allocator, kernels)
            measure(vlm, shared, mask, device)
            measure(vlm, naive, mask, device)
        for _ in range(repeats):
            samples["one_pass"].append(measure(vlm, shared, mask, device))
            samples["naive"].append(measure(vlm, naive, mask, device))
        row = {"model": name, "pairs": num_pairs, "sequences": 2 * num_pairs,
               "image_tokens_per_image": int((batch.inputs["input_ids"][0] == vlm.config.image_token_id).sum())}  # fmt: skip
        results.append(add_medians(row, samples, "naive", "one_pass"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pairs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dpo_vision_pass.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    try:
        results = run("tiny_qwen2_5_vl", VLM(str(tiny_vlm_path("qwen2_5_vl")), freeze_vision_tower=False),
                      args.pairs, args.repeats, device)  # fmt: skip
        large = VLM(str(large_vision_model(tmp / "large")), freeze_vision_tower=False,
                    processor_kwargs={"min_pixels": 224 * 224, "max_pixels": 224 * 224})  # fmt: skip
        results += run("qwen2_5_vl_vision8x256_224px", large, args.pairs, args.repeats, device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = "forward+backward of summed answer log-probs over chosen+rejected; vision tower trainable"
    write_report(args.out, what, device, args.threads, args.repeats, results)


if __name__ == "__main__":
    main()
