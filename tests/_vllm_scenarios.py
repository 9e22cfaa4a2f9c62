"""vLLM scenarios run in a subprocess (engines bind threads and keep global state): JSON report out.

    python tests/_vllm_scenarios.py REPORT.json SCENARIO [SCENARIO...]

Scenarios: ``colocate`` (parity, sampling, full and LoRA sync, two families), ``grpo_colocate`` (a few
GRPO steps through ``generation=vllm_colocate``), ``adapter_sync`` (LoRA-only sync), ``adapter_folder``
(an unmerged LoRA export as the policy), ``processor_settings`` (a policy's processor_kwargs reach
vLLM), ``bos_tokenizer`` (a tokenizer that adds BOS itself) and ``transformers_impl``
(model_impl=transformers; last: it patches transformers classes in-process). Each scenario's failure is
reported, not raised, so the other scenarios still run.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
GREEDY_TOKENS = 8


def _rows(n: int = 3) -> list[dict]:
    from lightning_vlm.data.synthetic import synthetic_rows

    return synthetic_rows("prompt", n)


def _greedy():
    from lightning_vlm.generation.base import SamplingSettings

    return SamplingSettings(max_new_tokens=GREEDY_TOKENS, temperature=0.0, do_sample=False)


def _train_step(vlm, lr: float = 0.05) -> None:
    """One real AdamW step of SFT on the HF model (the weights the trainer owns)."""
    from lightning_vlm.data.synthetic import synthetic_rows
    from lightning_vlm.losses.sft import sft_loss

    params = [p for p in vlm.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    inputs = vlm.encode_sft(synthetic_rows("sft", 4, seed=1))
    labels = inputs.pop("labels")
    mask = labels != -100
    logps, _ = vlm.token_logps(inputs, mask)
    sft_loss(logps, mask).backward()
    opt.step()
    opt.zero_grad()


def _compare(vlm, generator, rows: list[dict] | None = None) -> dict:
    """Greedy ids (HF and vLLM) and the largest log-prob difference on them."""
    from lightning_vlm.generation.hf import HFGenerator

    rows = rows or _rows()
    hf = HFGenerator(vlm).generate(rows, 1, _greedy())
    vl = generator.generate(rows, 1, _greedy())
    diff = max(
        (
            abs(a - b)
            for x, y in zip(hf.logprobs, vl.logprobs, strict=True)
            for a, b in zip(x, y, strict=False)
        ),
        default=0.0,
    )
    return {"hf": hf.completion_ids, "vllm": vl.completion_ids, "hf_truncated": hf.truncated,
            "vllm_truncated": vl.truncated, "logprob_max_diff": diff}  # fmt: skip


def _sampled(vlm, generator) -> dict:
    """Hot sampling: grouping, suppression, end-of-turn, and vLLM log-probs vs the trainer's."""
    from lightning_vlm.generation.base import SamplingSettings

    rows = _rows()
    out = {}
    hot = generator.generate(rows, 4, SamplingSettings(max_new_tokens=12, temperature=2.0))
    out["hot"] = {"ids": hot.completion_ids, "truncated": hot.truncated, "num_generations": hot.num_generations,
                  "logprob_lengths": [len(x) for x in hot.logprobs], "extras": hot.extras}  # fmt: skip
    warm = generator.generate(rows, 2, SamplingSettings(max_new_tokens=6, temperature=1.0))
    prompts = [rows[i] for i in warm.prompt_index]
    inputs = vlm.encode_prompt_completion(prompts, warm.completion_ids)
    mask = inputs.pop("completion_mask").bool()
    with torch.no_grad():
        trainer_logps, _ = vlm.token_logps(inputs, mask, 1.0, mask_suppressed=True)
    width = mask.shape[1] - max(len(c) for c in warm.completion_ids)
    diffs = [
        abs(float(trainer_logps[i, width + t]) - lp)
        for i, lps in enumerate(warm.logprobs)
        for t, lp in enumerate(lps)
    ]
    out["sampled_logprob_max_diff"] = max(diffs)
    out["seeded"] = _seeded_draws(generator, rows)
    from lightning_vlm.generation.hf import HFGenerator

    # Greedy groups: vLLM refuses n > 1 with greedy, so one answer per prompt is decoded and repeated.
    out["greedy_groups"] = {g.__class__.__name__: g.generate(rows, 3, _greedy()).completion_ids
                            for g in (generator, HFGenerator(vlm))}  # fmt: skip
    return out


def _seeded_draws(generator, rows: list[dict]) -> dict:
    """Completions under step seeds 7, 7 (after an unseeded draw moved the engine's own RNG) and 8."""
    from lightning_vlm.generation.base import SamplingSettings

    hot = SamplingSettings(max_new_tokens=8, temperature=2.0)

    def draw(seed):
        generator.set_seed(seed)
        try:
            return generator.generate(rows, 3, hot).completion_ids
        finally:
            generator.set_seed(None)

    first = draw(7)
    draw(None)
    return {"first": first, "again": draw(7), "other": draw(8)}


def colocate(paths: dict) -> dict:
    """Parity, sampling and weight sync through VLLMColocateGenerator, per family and mode."""
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    report: dict = {}
    for family, lora in (("qwen2_5_vl", None), ("gemma3", {"r": 8, "lora_alpha": 16})):
        start = time.perf_counter()
        vlm = VLM(paths[family], lora=lora, freeze_vision_tower=True)
        gen = VLLMColocateGenerator(vlm)
        r: dict = {"engine_seconds": time.perf_counter() - start, "before": _compare(vlm, gen)}
        if family == "qwen2_5_vl":
            r.update(_sampled(vlm, gen))
            r["suppressed"] = vlm.suppressed_token_ids
            r["end_of_turn_id"] = vlm.end_of_turn_id
        _train_step(vlm, lr=0.05 if lora is None else 0.02)
        r["sync_seconds"] = gen.sync_weights()
        r["after"] = _compare(vlm, gen)
        if family == "qwen2_5_vl":
            # LoRA on the same engine: adapters get a real step, then the merged weights are pushed.
            lora_vlm = VLM(paths[family], lora={"r": 8, "lora_alpha": 16}, freeze_vision_tower=True)
            gen.vlm = lora_vlm
            gen.sync_weights()
            r["lora_before"] = _compare(lora_vlm, gen)
            base = {k: v.clone() for k, v in lora_vlm.model.state_dict().items() if "lora_" not in k}
            _train_step(lora_vlm, lr=0.02)
            gen.sync_weights()
            r["lora_after"] = _compare(lora_vlm, gen)
            # The sync merged beside the model: the trainer's base weights are untouched.
            state = lora_vlm.model.state_dict()
            r["lora_base_untouched"] = all(torch.equal(v, state[k]) for k, v in base.items())
        r["is_lora"] = vlm.is_lora
        gen.close()
        report[family] = r
    return report


def families(paths: dict) -> dict:
    """Greedy parity through HFGenerator and VLLMColocateGenerator on mixed rows, every tiny family.

    The VLM runs in the dtype vLLM's CPU kernels take for the family (bf16 for Qwen3.5)."""
    from helpers import mixed_rows
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.families import family_of
    from lightning_vlm.models.tiny import TINY_FAMILIES, tiny_vlm_path
    from lightning_vlm.models.vlm import VLM

    report = {}
    for family in TINY_FAMILIES:
        try:
            path = str(tiny_vlm_path(family))
            from transformers import AutoConfig

            dtype = family_of(AutoConfig.from_pretrained(path)).vllm_cpu_dtype
            vlm = VLM(path, dtype=dtype).eval()
            generator = VLLMColocateGenerator(vlm, model_path=path)
            try:
                report[family] = {"dtype": dtype, **_compare(vlm, generator, mixed_rows())}
            finally:
                generator.close()
        except Exception as exc:  # one family's failure must not hide the others'
            report[family] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    return report


def adapter_sync(paths: dict) -> dict:
    """weight_sync="adapter": only the LoRA adapter goes to vLLM, which applies it."""
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    lora = {"r": 8, "lora_alpha": 16, "init_lora_weights": False}  # random adapters: policy != base
    vlm = VLM(paths["qwen2_5_vl"], lora=lora, freeze_vision_tower=True)
    gen = VLLMColocateGenerator(vlm, weight_sync="adapter")
    report = {"sync_seconds": [gen.sync_weights()], "before": _compare(vlm, gen)}
    _train_step(vlm, lr=0.02)
    report["sync_seconds"].append(gen.sync_weights())
    report["after"] = _compare(vlm, gen)
    report["adapters_loaded"] = sorted(gen.llm.llm_engine.list_loras())
    gen.close()
    return report


def adapter_folder(paths: dict, out_dir: str) -> dict:
    """An unmerged LoRA export as the policy's folder: vLLM loads its base, the first sync merges."""
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    lora = {"r": 8, "lora_alpha": 16, "init_lora_weights": False}  # random adapters: policy != base
    VLM(paths["qwen2_5_vl"], lora=lora).save_pretrained(out_dir, merge_lora=False)
    vlm = VLM(out_dir, lora={"r": 8, "lora_alpha": 16})
    try:
        VLLMColocateGenerator(vlm, weight_sync="adapter")
        refused = None
    except ValueError as exc:
        refused = str(exc)
    gen = VLLMColocateGenerator(vlm)
    base = _compare(vlm, gen)  # before any sync: the engine holds the folder's base
    gen.sync_weights()
    report = {"refused": refused, "base": base, "synced": _compare(vlm, gen)}
    gen.close()
    return report


def processor_settings(paths: dict) -> dict:
    """A policy whose processor has its own pixel limit (model.processor_kwargs): vLLM must encode the
    images into the same tokens, or it samples from another prompt than training scores."""
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    limits = {"min_pixels": 3136, "max_pixels": 3136}
    vlm = VLM(paths["qwen2_5_vl"], processor_kwargs=limits)
    rows = _rows()
    tokens = {
        name: int((v.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])["input_ids"]
                   == v.config.image_token_id).sum())
        for name, v in (("limited", vlm), ("default", VLM(paths["qwen2_5_vl"])))
    }  # fmt: skip
    gen = VLLMColocateGenerator(vlm)
    report = {
        "image_tokens": tokens,
        "engine_kwargs": gen.engine.mm_processor_kwargs,
        # the engine as vLLM built it: the processed-image cache off (EngineOptions.mm_processor_cache_gb)
        "mm_processor_cache_gb": gen.llm.llm_engine.model_config.multimodal_config.mm_processor_cache_gb,
        **_compare(vlm, gen, rows),
    }
    gen.close()
    return report


def bos_tokenizer(paths: dict) -> dict:
    """A tokenizer that adds BOS itself (real Gemma 3's; the tiny one does not), behind a chat template
    that writes it: the trainer encodes the templated text without special tokens, vLLM must too."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    folder = Path(tempfile.mkdtemp(prefix="bos-")) / "gemma3"
    shutil.copytree(paths["gemma3"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(folder)
    vlm = VLM(str(folder))
    adds = vlm.tokenizer("x")["input_ids"][0] == vlm.tokenizer.bos_token_id
    gen = VLLMColocateGenerator(vlm)
    report = {"tokenizer_adds_bos": adds, **_compare(vlm, gen)}
    gen.close()
    return report


def transformers_impl(paths: dict) -> dict:
    """model_impl=transformers. Run last: vLLM patches the transformers class process-wide."""
    from lightning_vlm.generation.engine_options import EngineOptions
    from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator
    from lightning_vlm.models.vlm import VLM

    start = time.perf_counter()
    vlm = VLM(paths["qwen2_5_vl"])
    gen = VLLMColocateGenerator(vlm, engine=EngineOptions(model_impl="transformers"))
    report = {"engine_seconds": time.perf_counter() - start, **_compare(vlm, gen)}
    # The trainer's HF model (built before the engine patched its class) still trains, and syncs.
    _train_step(vlm)
    gen.sync_weights()
    report["after"] = _compare(vlm, gen)
    gen.close()
    return report


def grpo_colocate(paths: dict, out_dir: str) -> dict:
    """A few GRPO steps with the colocated engine through the Hydra config."""
    from helpers import compose_train
    from lightning_vlm.training import train

    overrides = [
        "method=grpo", "generation=vllm_colocate", "logger=none", "callbacks=none",
        f"model.model_name_or_path={paths['qwen2_5_vl']}", "trainer.max_steps=3", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "data.batch_size=2",
        "method.num_generations=4", "method.steps_per_generation=2",
    ]  # fmt: skip
    cfg = compose_train(overrides, Path(out_dir))
    start = time.perf_counter()
    metrics, objects = train(cfg)
    callback = next(c for c in objects["trainer"].callbacks if type(c).__name__ == "VLLMGeneration")
    return {
        "seconds": time.perf_counter() - start,
        "metrics": metrics,
        "global_step": objects["trainer"].global_step,
        "num_syncs": len(callback.sync_seconds),
        "generator_restored": type(objects["module"].generator).__name__,
        "engine_closed": callback.generator is None,
    }


if __name__ == "__main__":
    report_path, scenarios = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(2)
    from lightning_vlm.models.tiny import tiny_vlm_path

    family_paths = {f: str(tiny_vlm_path(f)) for f in ("qwen2_5_vl", "gemma3")}
    report = {}
    for name in scenarios:
        start = time.perf_counter()
        try:
            if name in ("grpo_colocate", "adapter_folder"):
                report[name] = globals()[name](family_paths, str(Path(report_path).parent / name))
            else:
                report[name] = globals()[name](family_paths)
        except Exception as exc:  # one scenario's failure must not hide the others'
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        report[name]["scenario_seconds"] = time.perf_counter() - start
        Path(report_path).write_text(json.dumps(report, default=str))
