"""Two processes (Lightning DDP, gloo, 1 torch thread each) compute what one process computes.

One torchrun launch runs every two-process scenario (``_ddp_scenarios.py``); each test compares
its result with a one-process run made here:
- world 2 × batch 2 and world 1 × batch 4 give the same weights after 3 optimizer steps (and, for the
  offline methods, the same logged step metrics), for every
  method (the online ones on rollouts that depend only on the prompt, so both see the same samples;
  GRPO with several loss types, GSPO, GDPO, the adaptive entropy bonus and dynamic sampling),
  under DDP and, for SFT (also with text-only rows on one rank), KTO (text-only rows on one rank), DPO, GRPO (also with a row skipped at
  load), RLOO and Online DPO, under FSDP (torch's FSDP runs on CPU);
- each rank trains on a disjoint half of the epoch's rows, together the one-process rows, also
  across a mid-epoch resume, which continues bitwise exactly;
- a two-process checkpoint resumed on one process continues the epoch, with a warning.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from ddp_helpers import (
    COMMON,
    EQUIVALENCE,
    EXPORTS,
    FSDP_EQUIVALENCE,
    ONE_PROCESS,
    correction_inputs,
    write_variable_length_data,
)
from launch import torchrun

from helpers import ROOT, compose_train
from lightning_vlm.losses.importance import rollout_correction
from lightning_vlm.training import train

pytestmark = [pytest.mark.slow, pytest.mark.ddp]
SCRIPT = ROOT / "tests" / "_ddp_scenarios.py"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, monkeypatch_module):
    path = write_variable_length_data(tmp_path_factory.mktemp("ddp_data"))
    monkeypatch_module.setenv("DDP_TEST_DATA", str(path))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def two_processes(tiny_path, data_dir, tmp_path_factory):
    """Runs every two-process scenario in one torchrun launch (~1 min); returns its output folder."""
    tiny_path()  # built here, so the processes only read the cache
    out = tmp_path_factory.mktemp("ddp")
    scenarios = [
        "collectives",
        *[f"equivalence:{n}" for n in EQUIVALENCE],
        *[f"fsdp:{n}" for n in FSDP_EQUIVALENCE],
        "rows",
        "fsdp_rows",
        "fsdp_ref_sync_rows",
        "fsdp_export",
    ]
    proc = torchrun(SCRIPT, [str(out), *scenarios], timeout=900)
    errors = {p.name: p.read_text() for p in out.glob("*.error")}
    if proc.returncode != 0 or errors:
        pytest.fail(f"torchrun failed (rc {proc.returncode}): {errors or proc.stderr[-5000:]}")
    return out


def _one_process(name: str, tmp_path) -> tuple[dict[str, torch.Tensor], dict]:
    path = tmp_path / f"{name}.pt"
    overrides = [*COMMON, *EQUIVALENCE[name], *ONE_PROCESS]
    metrics, _ = train(compose_train([*overrides, "+callbacks.save._target_=ddp_helpers.SaveWeights",
                                      f"+callbacks.save.path={path}"], tmp_path))  # fmt: skip
    return torch.load(path, weights_only=True), metrics


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """Each scenario's one-process run, run once for both its DDP and its FSDP comparison."""
    runs: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}

    def get(name: str) -> tuple[dict[str, torch.Tensor], dict]:
        if name not in runs:
            runs[name] = _one_process(name, tmp_path_factory.mktemp(f"one_{name}"))
        return runs[name]

    return get


# Dr. GRPO's constant normaliser leaves each group's gradient an exact sum of terms that cancel, so the
# order the ranks add them in shows more: 1.3e-5 apart on an AMD EPYC, where every other method stays
# under 4e-7 (a wrong reduction moves weights by the update's size, >= 1e-2 here).
ATOL = {"grpo_dr_grpo": 1e-4}
# The offline methods' logged metrics (train/* each step, val/* for the validated KTO scenarios) describe the
# whole batch, as TRL's gathered metrics do: rank 0 logs on two processes what one process logs.
SAME_LOGGED_METRICS = (
    "sft",
    "sft_accumulated",
    "sft_mixed",
    "dpo",
    "dpo_ref_sync",
    "mpo",
    "mpo_token_mean",
    "dpo_precomputed",
    "kto",
    "kto_mixed",
    "kto_apo_zero",
)

# Online metrics of a batch whose ranks hold unequal shares: pooled over every rank's items, not a mean of
# the ranks' means (ddp_helpers.EQUIVALENCE names the rows).
# With the value one process logs where it is known by hand (None: as one process logs it). The
# candidates' mean reward: 3 prompts' 4 candidates, the tied rows' all 0 (the ranks' means: 0.875, 0).
POOLED_ONLINE_METRICS = {
    "online_dpo_skipped_row": {"train/valid_pair_frac": 1 / 3, "train/candidates/reward": None}
}


@pytest.mark.parametrize(
    ("strategy", "name"), [("ddp", n) for n in EQUIVALENCE] + [("fsdp", n) for n in FSDP_EQUIVALENCE]
)
def test_two_processes_update_like_one(strategy, name, two_processes, one_process, tiny_path):
    one, metrics = one_process(name)
    if "dynamic_sampling" in name:  # the last step's pool had two tied groups: filtered, then replaced
        assert metrics["train/dynamic_sampling/groups_filtered"] == 2
        assert metrics["train/dynamic_sampling/groups_kept"] == 2
        if strategy == "ddp":  # counts of both ranks together (a mean over ranks read half of them)
            logged = json.loads((two_processes / f"{name}.metrics.json").read_text())
            for count in ("groups_filtered", "groups_kept", "groups_filled"):
                key = f"train/dynamic_sampling/{count}"
                assert logged[key] == metrics[key], f"{key}: {logged[key]} on 2 processes"
    two = torch.load(two_processes / f"{name if strategy == 'ddp' else 'fsdp_' + name}.pt", weights_only=True)
    from lightning_vlm.models.vlm import VLM

    start = dict(VLM(tiny_path(), freeze_vision_tower=False).named_parameters())
    # LoRA runs: the adapters' B factors start at 0, the frozen base weights do not move
    moved = max(
        (one[k] - start[k].detach()).abs().max().item()
        if k in start
        else one[k].abs().max().item() * (".lora_B." in k)
        for k in one
    )
    assert moved > 1e-2, f"{name}: the weights hardly moved ({moved:.2e}); the comparison would be vacuous"
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, atol=ATOL.get(name, 1e-5), rtol=0, msg=f"{name}: {key}")
    if strategy == "ddp" and name in POOLED_ONLINE_METRICS:
        logged = json.loads((two_processes / f"{name}.metrics.json").read_text())
        for key, expected in POOLED_ONLINE_METRICS[name].items():
            if expected is not None:
                assert metrics[key] == pytest.approx(expected), f"{name}: {key} on one process"
            assert logged[key] == pytest.approx(metrics[key]), f"{name}: {key} on 2 processes"
    if strategy == "ddp" and name in SAME_LOGGED_METRICS:
        logged = json.loads((two_processes / f"{name}.metrics.json").read_text())
        # wall times (train/timing/*) are not numbers of the run
        steps = {k: v for k, v in metrics.items() if k.startswith(("train/", "val/")) and "/timing/" not in k}
        assert steps, f"{name}: nothing logged to compare"
        if name in ("kto", "kto_apo_zero"):  # validated: each rank holds one label, the pairs span both ranks
            assert 0 < metrics["val/rewards/accuracies"] < 1, metrics
        assert steps.keys() <= logged.keys(), f"{name}: {sorted(steps.keys() - logged.keys())}"
        for key, value in steps.items():
            # Float noise only: sums of log-probs over batches of other shapes (rank 0's half before: 70 %).
            assert logged[key] == pytest.approx(value, rel=1e-3, abs=1e-5), f"{name}: {key}"


def _rows(folder) -> list[list[str]]:
    return [json.loads((folder / f"rows-rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_train_on_disjoint_halves_of_the_one_process_epoch(two_processes, tmp_path):
    record = ["+callbacks.rows._target_=ddp_helpers.RecordRows", f"+callbacks.rows.dirpath={tmp_path}"]
    overrides = ["method=sft", "logger=none", "callbacks=none", "trainer.limit_val_batches=0",
                 "trainer.enable_progress_bar=false", "data.synthetic.num_train=24", "data.batch_size=4",
                 "trainer.max_steps=6", *record]  # fmt: skip
    train(compose_train(overrides, tmp_path))
    one = json.loads((tmp_path / "rows-rank0.json").read_text())
    assert len(set(one)) == 24, "the 24 rows must be distinguishable for this test to mean anything"
    whole = _rows(two_processes / "rows_whole")
    assert not set(whole[0]) & set(whole[1])
    assert sorted(whole[0] + whole[1]) == sorted(one)
    # Global batch k is the one-process batch k: rank 0 and rank 1 split it.
    for k in range(6):
        assert sorted(whole[0][2 * k : 2 * k + 2] + whole[1][2 * k : 2 * k + 2]) == sorted(
            one[4 * k : 4 * k + 4]
        )
    # Stopped after 3 of the epoch's 6 steps and resumed: each rank continues its own shard exactly.
    first, second = _rows(two_processes / "rows_first"), _rows(two_processes / "rows_second")
    assert [f + s for f, s in zip(first, second, strict=True)] == whole


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_ref_sync"])
def test_a_resumed_two_process_run_matches_the_uninterrupted_one_bitwise(two_processes, strategy):
    # FSDP: from a sharded checkpoint (each rank its shard of the weights and optimizer state); with DPO's
    # TR-DPO syncs every 2 steps, its metadata also holds the reference moved at step 2
    tag = "rows" if strategy == "ddp" else f"{strategy}_rows"
    whole = torch.load(two_processes / f"{tag}_whole.pt", weights_only=True)
    resumed = torch.load(two_processes / f"{tag}_resumed.pt", weights_only=True)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert (two_processes / f"{tag}_ckpt" / "mid.ckpt").is_dir() == (strategy != "ddp")


def test_resuming_on_another_world_size_continues_the_epoch_with_a_warning(two_processes, tmp_path, caplog):
    record = ["+callbacks.rows._target_=ddp_helpers.RecordRows", f"+callbacks.rows.dirpath={tmp_path}"]
    overrides = ["method=sft", "logger=none", "callbacks=none", "trainer.limit_val_batches=0",
                 "trainer.enable_progress_bar=false", "data.synthetic.num_train=24", "data.batch_size=4",
                 "trainer.max_steps=6", f"ckpt_path={two_processes / 'rows_ckpt' / 'mid.ckpt'}", *record]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        train(compose_train(overrides, tmp_path))
    assert any("written by 2 processes at" in m and "with 1 processes at" in m for m in caplog.messages)
    seen_before = _rows(two_processes / "rows_first")
    after = json.loads((tmp_path / "rows-rank0.json").read_text())
    whole = _rows(two_processes / "rows_whole")
    # The 12 rows of steps 4-6 (3 batches of 4 on one process): the rest of the epoch, nothing twice.
    assert len(after) == 12
    assert sorted(seen_before[0] + seen_before[1] + after) == sorted(whole[0] + whole[1])


def test_collectives_take_a_different_number_of_rows_on_each_rank(two_processes):
    results = [json.loads((two_processes / f"collectives-rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["gathered"] == [[0.0] * 3, [10.0] * 3, [11.0] * 3]
        assert result["sizes"] == [1, 2] and result["offset"] == [0, 1][rank]
        assert result["local"] == [[0.0], [10.0, 11.0]][rank]
        assert result["normalizer"] == 1.5  # (1 + 2) / 2
        assert result["pooled"] == 7.0  # the mean of all 3 rows (0, 10, 11), not of the means 0 and 10.5
        assert result["pooled_one_empty"] == 5.0  # rank 0's one row (5); rank 1's empty mean is NaN
        assert result["objects"] == [{"rank": 0}, {"rank": 1}]
        # Every rank calls an LM head that gathers its weights (ZeRO-3) as often as the rank with the most
        # chunks, in forward and in backward's recomputation; rank 1 called it once, or never: a hang.
        assert result["head_chunks"] == {"uneven": [3, 6, True], "one_empty": [3, 6, True]}
    # A DDP step where rank 1 scores no token (all its completions masked): the head's gradient is rank 0's
    # halved on both ranks. Rank 1's head got no gradient, and DDP waited for it forever.
    alone = torch.tensor(results[0]["ddp_one_empty"][1])
    assert alone.abs().max() > 0.01
    for result in results:
        torch.testing.assert_close(torch.tensor(result["ddp_one_empty"][0]), alone / 2)
    # The rollout correction's logged metrics are those of one process holding every rank's rows. They were
    # means (min, max) over ranks of each rank's values, and a rank without rows gave 0 for its ratios.
    for level in ("token", "sequence"):
        for tag, ranks in (("", (0, 1)), ("_one_empty", (0,))):
            parts = [correction_inputs(r) for r in ranks]
            width = max(p[0].shape[1] for p in parts)
            old, sampler, mask = (torch.cat([F.pad(p[i], (0, width - p[i].shape[1])) for p in parts])
                                  for i in range(3))  # fmt: skip
            _, expected = rollout_correction(old, sampler, mask, level, "truncate", clip_max=1.5)
            for result in results:
                logged = result[f"correction_{level}{tag}"]
                assert logged.keys() == expected.keys(), (level, tag)
                for name, value in expected.items():
                    assert logged[name] == pytest.approx(float(value), rel=1e-6), (level, tag, name)


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_an_fsdp_run_exports_the_folder_one_process_exports(variant, two_processes, tiny_path, tmp_path):
    # Rank 0 alone called save_pretrained, whose state_dict() is a collective under FSDP: the run hung at
    # its end with a folder of configs and no weights. Every rank now gathers (parallel/export.py).
    from safetensors.torch import load_file

    overrides = [*COMMON, *EQUIVALENCE["sft"], *ONE_PROCESS, *EXPORTS[variant],
                 "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                 f"+callbacks.export.dirpath={tmp_path / 'hf_model'}"]  # fmt: skip
    train(compose_train(overrides, tmp_path))
    one = load_file(tmp_path / "hf_model" / "model.safetensors")
    two = load_file(two_processes / f"fsdp_export_{variant}" / "hf_model" / "model.safetensors")
    start = load_file(f"{tiny_path()}/model.safetensors")
    assert one.keys() == two.keys() == start.keys()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-2, "trained weights, not the initial"
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, atol=1e-5, rtol=0, msg=key)
