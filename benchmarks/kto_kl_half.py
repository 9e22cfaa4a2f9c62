"""KTO step (loss + backward): the KL half without autograd (two forwards of B rows sharing one vision pass)
vs the earlier single forward over all 2B sequences with autograd.

Usage: ``python benchmarks/kto_kl_half.py [--repeats 7] [--out benchmarks/results/kto_kl_half.json]``.
Measures, in one run and interleaved (machine noise hits both paths alike), the median step time and the
peak memory (``_peak.timed_peak``) of both paths for a few batch sizes, on the tiny zoo Qwen2.5-VL and on
the same recipe with a larger language model (4 layers, width 512), where the decoder's activations are
most of the step's memory. Both paths compute the same loss (checked each run) and gradients
(tests/test_kto_passes.py).
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
from lightning_vlm.losses.kto import kto_losses, kto_reference_point  # noqa: E402
from lightning_vlm.methods.kto import KTO, mismatched_completions  # noqa: E402
from lightning_vlm.methods.preference_batch import encode_pairs, split_pairs  # noqa: E402
from lightning_vlm.models.tiny import tiny_vlm_path  # noqa: E402
from lightning_vlm.models.vlm import VLM  # noqa: E402


def larger_language_model(folder: Path) -> Path:
    """The tiny Qwen2.5-VL recipe with a 4-layer, 512-wide language model (random weights), saved to ``folder``."""
    base = tiny_vlm_path("qwen2_5_vl")
    config = AutoConfig.from_pretrained(base)
    config.text_config.update({"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4, "hidden_size": 512, "intermediate_size": 1536,
                               "num_attention_heads": 16, "num_key_value_heads": 4})  # fmt: skip
    config.vision_config.update({"out_hidden_size": 512})
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    AutoProcessor.from_pretrained(base).save_pretrained(folder)
    return folder


def single_forward_loss(module: KTO, rows: list[dict]) -> torch.Tensor:
    """The loss as computed before: matched and mismatched answers in one forward of 2B sequences (one vision
    pass per row through image groups), all with autograd, the KL estimate detached afterwards."""
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": o, "images": r["images"]}
             for r, o in zip(rows, mismatched_completions(rows), strict=True)]  # fmt: skip
    batch = encode_pairs(module.vlm, pairs)
    inputs = {k: v.to(module.device) for k, v in batch.inputs.items()}
    mask = batch.completion_mask.to(module.device)
    logps, kl_logps = split_pairs(module.vlm.token_logps(inputs, mask)[0].sum(dim=1))
    ref, kl_ref = split_pairs(module.ref.token_logps(inputs, mask)[0].sum(dim=1))
    z0 = kto_reference_point((kl_logps - kl_ref).detach())
    desirable = torch.tensor([bool(r["label"]) for r in rows], device=module.device)
    return kto_losses(logps - ref, desirable, z0, module.hparams.beta).mean()


def step(vlm: VLM, loss, rows: list[dict], device: torch.device) -> tuple[float, float]:
    """Seconds and peak extra bytes of ``loss(rows)`` and its backward."""
    vlm.model.zero_grad(set_to_none=True)
    return timed_peak(lambda: loss(rows).backward(), device)


def run(name: str, vlm: VLM, sizes: list[int], repeats: int, device: torch.device) -> list[dict]:
    """Both paths at each number of rows; medians and ratios."""
    vlm.model.to(device).train()
    module = KTO(vlm, optimizer=lambda params: torch.optim.SGD(params, lr=0.0)).to(device)
    module.ref.to(device)
    with torch.no_grad():  # off its reference, so the rewards, z0 and the loss check below are not trivial
        rng = torch.Generator().manual_seed(0)
        for p in vlm.parameters():
            p.add_(torch.randn(p.shape, generator=rng).to(p) * 0.02)
    paths = {"kl_half_no_grad": lambda rows: module._loss(rows, train=True)[0],
             "single_forward": lambda rows: single_forward_loss(module, rows)}  # fmt: skip
    results = []
    for size in sizes:
        rows = synthetic_rows("unpaired", size, seed=0)
        with torch.no_grad():
            losses = [float(path(rows)) for path in paths.values()]
        assert abs(losses[0] - losses[1]) < 1e-5 * max(1.0, abs(losses[1])), losses

        samples: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
        for _ in range(2):  # warm-up (allocator, kernels)
            for path in paths.values():
                step(vlm, path, rows, device)
        for _ in range(repeats):
            for label, path in paths.items():
                samples[label].append(step(vlm, path, rows, device))
        row = {"model": name, "rows": size, "loss": losses[0]}
        results.append(add_medians(row, samples, "single_forward", "kl_half_no_grad", "single_over_no_grad"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kto_kl_half.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="kto-bench-"))
    try:
        results = run(
            "tiny_qwen2_5_vl", VLM(str(tiny_vlm_path("qwen2_5_vl"))), args.rows, args.repeats, device
        )
        larger = VLM(str(larger_language_model(tmp / "larger")))
        results += run("qwen2_5_vl_text4x512", larger, args.rows, args.repeats, device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = (
        "KTO loss + backward (policy forward(s) with the reference's, z0 from the mismatched answers); "
        "vision tower frozen (the default)"
    )
    write_report(args.out, what, device, args.threads, args.repeats, results)


if __name__ == "__main__":
    main()
