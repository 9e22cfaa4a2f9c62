"""FSDP (2 CPU processes, gloo) with vLLM: GRPO pushes the sharded policy into one colocated engine per
rank (full weights, or the LoRA adapter alone) and into a server, gathering one FSDP unit at a time.

After every sync each engine's greedy completions equal HF generate's on the gathered weights; the
units gathered one by one are together exactly the full state, and the largest is a fraction of it.
Each run is its own torchrun launch (one engine per process).
"""

from __future__ import annotations

import json

import pytest
from launch import torchrun

from helpers import ROOT
from lightning_vlm.serving.process import log_tail

pytestmark = [pytest.mark.slow, pytest.mark.ddp, pytest.mark.vllm]
SCRIPT = ROOT / "tests" / "_ddp_scenarios.py"


@pytest.mark.parametrize("mode", ["full", "adapter", "server"])
def test_grpo_under_fsdp_syncs_vllm_unit_by_unit(mode, tiny_path, tmp_path):
    tiny_path()
    proc = torchrun(SCRIPT, [str(tmp_path), f"fsdp_vllm:{mode}"], timeout=600)
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.error")}
    server_log = tmp_path / f"fsdp_vllm_{mode}" / "vllm_server.log"
    tail = log_tail(server_log, lines=200) if server_log.exists() else ""  # room for a stack dump
    assert proc.returncode == 0 and not errors, (errors or proc.stderr[-8000:], f"server log:\n{tail}")
    folder = tmp_path / f"fsdp_vllm_{mode}"
    for rank in (0, 1):
        probes = json.loads((folder / f"parity-rank{rank}.json").read_text())
        assert [p["step"] for p in probes] == [0, 1, 2, 3]
        for probe in probes:
            assert probe["vllm"] == probe["hf"], (mode, rank, probe["step"])
        if mode != "server":
            # vLLM's default in-process executor gave every rank's engine local rank 0 (on GPUs: every
            # engine on cuda:0); the external launcher gets the rank and the rank's device index.
            engine = json.loads((folder / f"engine-rank{rank}.json").read_text())
            assert engine == {"backend": "external_launcher", "rank": rank, "local_rank": rank}, engine
    chunks = json.loads((folder / "chunks.json").read_text())
    assert chunks["same"], "the units gathered one by one must be the full state"
    assert len(chunks["sizes"]) >= 5 and max(chunks["sizes"]) < 0.7 * chunks["total"], chunks
