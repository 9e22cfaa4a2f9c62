"""Helpers of the multi-process tests: rollouts keyed by the prompt, row recording, launching torchrun.

``KeyedGenerator`` gives every prompt the same completions whichever rank samples it and whatever
batch it is in (they are drawn from a RNG seeded by the row's content), with lengths that differ
from prompt to prompt: so one process and two must compute the same update, and only a loss that
normalises over all ranks' tokens does.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import lightning as L
import torch

from helpers import REF_SYNC
from lightning_vlm.generation.base import OwnWeightsGenerator, Rollouts, SamplingSettings


def row_digest(row: dict) -> str:
    """A digest of a row's text and image pixels (identifies the row across processes)."""
    h = hashlib.sha256(json.dumps({k: v for k, v in row.items() if k != "images"}, sort_keys=True,
                                  default=str).encode())  # fmt: skip
    for image in row.get("images", []):
        h.update(image.tobytes())
    return h.hexdigest()[:16]


def full_weights(trainer: L.Trainer):
    """Under FSDP every rank holds a shard: a context with the full weights gathered (a collective)."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = trainer.strategy.model
    return (
        FSDP.summon_full_params(root, writeback=False) if isinstance(root, FSDP) else contextlib.nullcontext()
    )


class KeyedGenerator(OwnWeightsGenerator):
    """Completions that depend only on the prompt row: 1-``max_new_tokens`` ordinary tokens, most ending
    at the end-of-turn token."""

    is_policy = True

    def __init__(self, vlm, max_new_tokens: int) -> None:
        self.vlm = vlm
        self.max_new_tokens = max_new_tokens
        banned = {*vlm.suppressed_token_ids, vlm.end_of_turn_id, vlm.pad_token_id, vlm.tokenizer.eos_token_id}
        self.pool = [t for t in range(3, 200) if t not in banned]

    def generate(self, rows: list[dict], num_generations: int, sampling: SamplingSettings) -> Rollouts:
        ids, truncated = [], []
        for row in rows:
            rng = random.Random(row_digest(row))
            for _ in range(num_generations):
                n = rng.randint(1, self.max_new_tokens)
                tokens = [rng.choice(self.pool) for _ in range(n)]
                cut = n == self.max_new_tokens and rng.random() < 0.5
                if not cut:
                    tokens[-1] = self.vlm.end_of_turn_id
                ids.append(tokens)
                truncated.append(cut)
        texts = self.vlm.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return Rollouts(list(rows), ids, texts, truncated, num_generations)


class KeyedRollouts(L.Callback):
    """Replaces an online method's generator with :class:`KeyedGenerator` at setup."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.generator = KeyedGenerator(pl_module.vlm, pl_module.sampling.max_new_tokens)


class RecordRows(L.Callback):
    """Writes ``<dirpath>/rows-rank<r>.json``: the digests of the rows each training batch held."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += [row_digest(row) for row in batch]

    def on_fit_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rows-rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class SaveWeights(L.Callback):
    """Rank 0 writes the trained parameters to ``path`` at the end of fit (compared across runs)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer, pl_module) -> None:
        with full_weights(trainer):
            weights = {n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""):
                       p.detach().cpu().clone() for n, p in pl_module.vlm.named_parameters()}  # fmt: skip
        if trainer.is_global_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(weights, self.path)


# Per rank, the rows of (trainer - sampler) log-ratios and their completion masks that the collectives
# scenario pools: the ranks hold different numbers of rows, tokens and widths.
CORRECTION_ROWS = (
    ([[0.7, -0.7, 1.4], [0.4, -0.3, 0.0]], [[1, 1, 1], [1, 1, 0]]),
    ([[-1.1, 2.0]], [[1, 1]]),
)


def correction_inputs(rank: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rollout_correction``'s (old, sampler, mask) for ``CORRECTION_ROWS[rank]`` (its first ``rows``)."""
    ratios, mask = (torch.tensor(x, dtype=torch.float32)[:rows] for x in CORRECTION_ROWS[rank])
    return torch.zeros_like(ratios), -ratios, mask


def write_variable_length_data(dirpath: Path, n: int = 32) -> Path:
    """SFT and preference JSONL files (images as PNG files) whose answers have 1-5 words, and prompts
    whose ``tie`` column marks the rows where :func:`online_helpers.tie_marked_reward_fn` ties."""
    from lightning_vlm.data.synthetic import make_sample

    dirpath.mkdir(parents=True, exist_ok=True)
    words = ["it", "is", "surely", "very"]
    sft, preference, prompt, mixed, unpaired_mixed = [], [], [], [], []
    for i in range(n):
        sample = make_sample(0, i)
        sample.image.save(dirpath / f"{i}.png")
        answer = " ".join([*words[: i % 5], sample.answer])
        wrong = " ".join([*words[: (i // 5) % 5], sample.wrong_answer])
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample.question}]}]

        def said(text: str) -> list[dict]:
            return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

        sft.append({"messages": user + said(answer), "images": [f"{i}.png"]})
        # Odd rows text-only: read in order, rank 0 holds every image and rank 1 none.
        text = [{"role": "user", "content": [{"type": "text", "text": sample.question}]}]
        mixed.append(sft[-1] if i % 2 == 0 else {"messages": text + said(answer), "images": []})
        preference.append(
            {"prompt": user, "chosen": said(answer), "rejected": said(wrong), "images": [f"{i}.png"]}
        )
        # KTO's rows, laid out as sft_mixed's (rank 1 text-only); labels in pairs, so each rank holds both.
        label = i // 2 % 2 == 0
        unpaired_mixed.append({"prompt": user if i % 2 == 0 else text, "completion": said(answer if label else wrong),
                               "label": label, "images": [f"{i}.png"] if i % 2 == 0 else []})  # fmt: skip
        # In batches of 4 read in order, the first row ties; in every other batch the second one too.
        tie = i % 4 == 0 or i % 8 == 1
        prompt.append({"prompt": user, "images": [f"{i}.png"], "solution": sample.answer, "tie": tie})
    # Row 3's image does not decode: skipped at load (data.on_bad_row=skip), on rank 1 (rows 1, 3).
    (dirpath / "bad.png").write_bytes(b"not a png")
    skip = [{**row, "images": ["bad.png"]} if i == 3 else row for i, row in enumerate(prompt)]
    files = {"sft": sft, "preference": preference, "prompt": prompt, "prompt_skip": skip, "sft_mixed": mixed,
             "unpaired_mixed": unpaired_mixed}  # fmt: skip
    for name, rows in files.items():
        (dirpath / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dirpath


# ---- the equivalence scenarios: one process with batch 4 vs two with batch 2 -----------------------------
# SGD: the update is linear in the gradient, so equal weights mean equal gradients (AdamW's
# normalisation would magnify float noise on parameters whose gradient is ~0).
COMMON = [
    "logger=none", "callbacks=none", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
    "data.synthetic.num_train=32", "method.optimizer._target_=torch.optim.SGD", "method.optimizer.lr=0.5",
    "trainer.max_steps=3",
]  # fmt: skip
GENERATION = [
    "+callbacks.keyed._target_=ddp_helpers.KeyedRollouts",
    "method.num_generations=4", "method.max_completion_length=4", "method.micro_batch_size=2",
]  # fmt: skip
ONLINE = [*GENERATION, "method.reward_funcs=[online_helpers.token_reward_fn]"]
# A 2-batch validation at the end of fit (the 32 rows unpaired: 64 rows of alternating labels).
KTO_VALIDATION = [
    "data.val=${oc.env:DDP_TEST_DATA}/preference.jsonl",
    "trainer.limit_val_batches=2",
    "method.val_max_new_tokens=2",
]
# Answers of 1 to 5 words: token counts differ between ranks, so only a loss normalised over all
# ranks' tokens matches the one-process run (see write_variable_length_data).
EQUIVALENCE: dict[str, list[str]] = {
    "sft": ["method=sft", "data.train=${oc.env:DDP_TEST_DATA}/sft.jsonl"],
    # 2 accumulated micro-batches a step: divided by the tokens of both, on both ranks (step_tokens); no
    # clipping, which would keep only the gradient's direction
    "sft_accumulated": [
        "method=sft",
        "data.train=${oc.env:DDP_TEST_DATA}/sft.jsonl",
        "trainer.accumulate_grad_batches=2",
        "trainer.gradient_clip_val=null",
    ],  # fmt: skip
    # Text-only rows on rank 1, image rows on rank 0, the vision tower trained: rank 1 must still run it
    # (FSDP gathers its weights, DDP reduces its gradients), in training and in the final validation's
    # generate, as vision_every_rank makes it.
    "sft_mixed": [
        "method=sft",
        "data.train=${oc.env:DDP_TEST_DATA}/sft_mixed.jsonl",
        "data.val=${oc.env:DDP_TEST_DATA}/sft_mixed.jsonl",
        "data.shuffle=false",
        "model.freeze_vision_tower=false",
        "trainer.limit_val_batches=1",
    ],  # fmt: skip
    "dpo": ["method=dpo", "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl"],
    "mpo": ["method=mpo", "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl"],
    # TR-DPO: the reference mixed with the policy after steps 1 and 2, alike on every rank (under FSDP from
    # the gathered units), so steps 2 and 3 score against the same moved reference as one process
    "dpo_ref_sync": ["method=dpo", "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl", *REF_SYNC],
    # TRL's sft term (mean over every chosen token of the batch): normalised by all ranks' tokens
    "mpo_token_mean": [
        "method=mpo",
        "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl",
        "method.sft_normalization=token_mean",
    ],  # fmt: skip
    # reference log-probs computed once, each rank a share of the rows, then exchanged
    "dpo_precomputed": [
        "method=dpo",
        "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl",
        "method.precompute_ref_logps=true",
    ],  # fmt: skip
    # the same with LoRA: the reference is the policy with its adapters off, a sharded model under FSDP
    "dpo_precomputed_lora": [
        "method=dpo",
        "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl",
        "method.precompute_ref_logps=true",
        "lora=default",
    ],  # fmt: skip
    # KTO reads the pairs as unpaired rows; z0 pairs each row with the previous one of the global batch
    # Validated too: the unpaired rows' labels alternate, so each rank holds one label, and the ranking
    # accuracy exists only over both ranks' rows.
    "kto": [
        "method=kto",
        "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl",
        *KTO_VALIDATION,
    ],  # fmt: skip
    # KTO on sft_mixed's layout (rank 1 text-only, the tower trained): the KL half reuses the matched half's
    # image features, and neither rank runs the tower again there (vision_every_rank), in training and in
    # the validation's loss.
    "kto_mixed": [
        "method=kto",
        "data.train=${oc.env:DDP_TEST_DATA}/unpaired_mixed.jsonl",
        "data.val=${oc.env:DDP_TEST_DATA}/unpaired_mixed.jsonl",
        "data.shuffle=false",
        "model.freeze_vision_tower=false",
        "trainer.limit_val_batches=1",
        "method.val_max_new_tokens=2",
    ],  # fmt: skip
    # APO-zero: one sequence per row and no z0; each rank's mean rescaled to the mean over all rows
    "kto_apo_zero": [
        "method=kto",
        "data.train=${oc.env:DDP_TEST_DATA}/preference.jsonl",
        "method.loss_type=apo_zero_unpaired",
        *KTO_VALIDATION,
    ],  # fmt: skip
    "grpo_dapo": ["method=grpo", *ONLINE, "method.loss_type=dapo"],
    # two optimizer steps per generation (old log-probs, clipping) and a KL to the reference
    "grpo_grpo": [
        "method=grpo",
        *ONLINE,
        "method.loss_type=grpo",
        "method.beta=0.04",
        "method.steps_per_generation=2",
        "trainer.max_steps=4",
    ],  # fmt: skip
    "grpo_dr_grpo": ["method=grpo", *ONLINE, "method.loss_type=dr_grpo", "method.scale_rewards=batch"],
    # GSPO: one ratio per sequence, clipped on the second step of each generation
    "gspo": ["method=gspo", *ONLINE, "trainer.max_steps=4"],
    # GDPO: each reward normalised in its group, then the weighted sum normalised over all ranks' rows
    "gdpo": [
        "method=grpo",
        *GENERATION,
        "method.reward_funcs=[online_helpers.token_reward_fn,online_helpers.first_token_reward_fn]",
        "method.reward_weights=[1.0,0.5]",
        "method.multi_objective_aggregation=normalize_then_sum",
    ],  # fmt: skip
    # CISPO's clipped IS weight and an entropy bonus whose controller follows all ranks' mean entropy.
    # Measured: step 2's entropy is 3.07 on rank 0, 1.62 on rank 1, 2.23 over both; a target between
    # them turns the bonus off on step 3 for the global mean only (a per-rank controller: diff 1.6e-3).
    "grpo_cispo_entropy": [
        "method=grpo",
        *ONLINE,
        "method.loss_type=cispo",
        "method.epsilon_high=5.0",
        "method.entropy_coef=0.05",
        "method.use_adaptive_entropy=true",
        "method.entropy_coef_delta=0.02",
        "method.entropy_target=2.0",
    ],  # fmt: skip
    # DAPO's dynamic sampling (one step per generation), each rank filtering its own pool: one process's rounds
    # of 2 prompts out of 4 vs two processes' rounds of 1 out of 2 (rows 0, 2 and 1, 3 of the global batch). Tied
    # rows (first of each batch, the second of every other) sit where both draw the same replacements: rank 0
    "dapo_dynamic_sampling": [  # alone or both ranks run a second round; the other joins it (a collective).
        "method=dapo",
        "method.steps_per_generation=1",
        *GENERATION,
        "method.reward_funcs=[online_helpers.tie_marked_reward_fn]",
        "data.train=${oc.env:DDP_TEST_DATA}/prompt.jsonl",
        "data.shuffle=false",
    ],  # fmt: skip
    # Only the top half of the tokens by entropy trained (and an entropy bonus over them): the threshold is
    # a quantile of every rank's tokens, as TRL's. One micro-batch a step, so that one process's micro-batch
    # holds the same tokens as the two ranks' together (micro-batches would split them differently).
    "grpo_top_entropy": [
        "method=grpo",
        *[o for o in ONLINE if not o.startswith("method.micro_batch_size")],
        "method.top_entropy_quantile=0.5",
        "method.entropy_coef=0.05",
    ],  # fmt: skip
    # The first global batch's row 3 is skipped at load: rank 1 holds 4 completions, rank 0 holds 8. Both
    # must run as many forward passes (FSDP gathers weights in each): rank 1's 4 in passes of 1.
    "grpo_skipped_row": [
        "method=grpo",
        *ONLINE,
        "method.loss_type=dapo",
        "method.num_iterations=2",
        "data.train=${oc.env:DDP_TEST_DATA}/prompt_skip.jsonl",
        "data.shuffle=false",
        "data.on_bad_row=skip",
    ],  # fmt: skip
    "rloo": ["method=rloo", *ONLINE, "method.normalize_advantages=true"],
    "online_dpo": ["method=online_dpo", *ONLINE, "method.num_generations=2"],
    # The first batch as in grpo_skipped_row (rank 0: rows 0 and 2, rank 1: row 1), rows 0 and 1 tied:
    # rank 0 has half its pairs valid, rank 1 none, the three rows one in three. The loss and the logged
    # fraction are over every rank's pairs (a mean of the ranks' fractions would say one in four).
    "online_dpo_skipped_row": [
        "method=online_dpo",
        *GENERATION,
        "method.num_generations=2",
        "method.reward_funcs=[online_helpers.tie_marked_reward_fn]",
        "data.train=${oc.env:DDP_TEST_DATA}/prompt_skip.jsonl",
        "data.shuffle=false",
        "data.on_bad_row=skip",
        "trainer.max_steps=1",
    ],  # fmt: skip
}
ONE_PROCESS = ["data.batch_size=4"]
TWO_PROCESSES = ["data.batch_size=2", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
# FSDP on CPU (gloo): the same strategy class as on GPUs, each decoder layer and vision block a unit.
TWO_PROCESSES_FSDP = ["data.batch_size=2", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
# ExportHFModel under FSDP (scenario fsdp_export): SFT as in EQUIVALENCE["sft"], full weights or LoRA merged
EXPORTS = {"full": [], "lora": ["lora=default"]}
FSDP_EQUIVALENCE = (
    "sft",
    "sft_mixed",
    "kto_mixed",
    "dpo",
    "dpo_ref_sync",
    "dpo_precomputed_lora",
    "grpo_dapo",
    "grpo_skipped_row",
    "rloo",
    "online_dpo",
)


LEARN_BATCHES = int(__import__("os").environ.get("LEARN_BATCHES", "300"))


def learning_overrides(warm: str, generation: str, out: Path) -> list[str]:
    """GRPO from ``warm`` on 2 processes × 2 prompts (the one-process default of 4 per step), validated
    before and after on the 64 held-out prompts (32 per rank)."""
    return [
        "method=grpo", f"generation={generation}", f"model.model_name_or_path={warm}", "logger=csv",
        "callbacks=none", "validate_before_fit=true", "trainer.max_steps=-1", "trainer.max_epochs=1",
        f"trainer.limit_train_batches={LEARN_BATCHES}", f"trainer.val_check_interval={LEARN_BATCHES}",
        "trainer.enable_progress_bar=false", *TWO_PROCESSES,
        "+callbacks.parity._target_=ddp_probes.ParityProbe", f"+callbacks.parity.dirpath={out}",
        "+callbacks.parity.every=50",
    ]  # fmt: skip
