"""Generation throughput: vLLM (colocated, through our generator) vs HF ``generate``, on two models.

Usage: ``python benchmarks/generation_throughput.py [--repeats 5] [--prompts 8] [--generations 4]
[--new-tokens 32] [--out benchmarks/results/generation_throughput.json]``.
Models: the tiny zoo Qwen2.5-VL (~0.4M parameters) and the same recipe scaled up (text 512 wide, 8
layers; vision 256 wide, 4 blocks; ~30M parameters, random weights). Each measurement samples
``prompts x generations`` completions of up to ``new-tokens`` tokens (temperature 1, one 112 px
image per prompt) and counts the completion tokens actually produced; tokens/s is the median over
``repeats`` timed runs after one warm-up, HF and vLLM runs interleaved so the load of a shared
machine hits both alike. Both run in one process, after vLLM's CPU engine has bound its threads
(as in colocated training).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_vlm.data.synthetic import synthetic_rows  # noqa: E402
from lightning_vlm.generation.base import SamplingSettings  # noqa: E402
from lightning_vlm.generation.hf import HFGenerator  # noqa: E402
from lightning_vlm.models.tiny import tiny_vlm_path  # noqa: E402
from lightning_vlm.models.vlm import VLM  # noqa: E402

LARGER = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 2}  # fmt: skip
LARGER_VISION = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "depth": 4,
    "num_heads": 4,
    "out_hidden_size": 512,
}


def larger_model(folder: Path) -> Path:
    """The tiny Qwen2.5-VL recipe scaled up (random weights), saved where transformers and vLLM load it."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from lightning_vlm.models.weight_names import save_for_hf_and_vllm

    base = tiny_vlm_path("qwen2_5_vl")
    config = AutoConfig.from_pretrained(base)
    for key, value in LARGER.items():
        setattr(config.text_config, key, value)
    # head_dim 64: vLLM's CPU attention accepts 32, 64, 80, ...; mrope sections sum to head_dim / 2.
    config.text_config.head_dim = 64
    config.text_config.layer_types = ["full_attention"] * LARGER["num_hidden_layers"]
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": [8, 12, 12]}
    for key, value in LARGER_VISION.items():
        setattr(config.vision_config, key, value)
    torch.manual_seed(0)
    save_for_hf_and_vllm(AutoModelForImageTextToText.from_config(config), folder)
    AutoProcessor.from_pretrained(base).save_pretrained(folder)
    return folder


def timed(generator, rows: list[dict], generations: int, sampling: SamplingSettings) -> tuple[float, int]:
    """Seconds and completion tokens of one generation call."""
    start = time.perf_counter()
    out = generator.generate(rows, generations, sampling)
    return time.perf_counter() - start, sum(len(ids) for ids in out.completion_ids)


def summary(runs: list[tuple[float, int]]) -> dict:
    """Median tokens/s (and its inputs) over timed runs."""
    rates = [n / t for t, n in runs]
    return {"tokens_per_s_median": statistics.median(rates), "seconds_median": statistics.median(t for t, _ in runs),
            "tokens_median": statistics.median(n for _, n in runs), "tokens_per_s_all": rates}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation_throughput.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = synthetic_rows("prompt", args.prompts)
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "tiny_qwen2_5_vl": tiny_vlm_path("qwen2_5_vl"),
            "larger_qwen2_5_vl": larger_model(Path(tmp)),
        }
        from lightning_vlm.generation.engine_options import EngineOptions
        from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator

        results: dict = {}
        for name, path in models.items():
            vlm = VLM(str(path))
            start = time.perf_counter()
            options = EngineOptions(extra={"max_num_seqs": args.prompts * args.generations})
            engine = VLLMColocateGenerator(vlm, engine=options)
            r = {"parameters": sum(p.numel() for p in vlm.model.parameters()),
                 "vllm_engine_start_s": time.perf_counter() - start, "vllm_sync_s": engine.sync_weights()}  # fmt: skip
            samplers = {"hf": HFGenerator(vlm), "vllm": engine}
            runs: dict[str, list] = {"hf": [], "vllm": []}
            for generator in samplers.values():  # warm-up
                timed(generator, rows, args.generations, sampling)
            # Interleaved, so the shared machine's load drifts hit both samplers alike.
            for _ in range(args.repeats):
                for key, generator in samplers.items():
                    runs[key].append(timed(generator, rows, args.generations, sampling))
            r.update({key: summary(v) for key, v in runs.items()})
            r["speedup"] = r["vllm"]["tokens_per_s_median"] / r["hf"]["tokens_per_s_median"]
            engine.close()
            results[name] = r
            print(name, {k: round(r[k]["tokens_per_s_median"]) for k in runs}, flush=True)
    report = {
        "benchmark": "generation_throughput",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "cuda": torch.cuda.is_available(),
            "torch": torch.__version__,
        },  # fmt: skip
        "note": "CPU, shared machine: timings are noisy; medians over repeats of one run.",
        "load_average_at_end": os.getloadavg(),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: {m: v[m] for m in ("speedup",)} for k, v in results.items()}))


if __name__ == "__main__":
    main()
