"""The GPUs a vLLM server started by the trainer runs on: never the trainer's (it inherited them, and claimed
0.9 of rank 0's memory), named in the trainer's own CUDA_VISIBLE_DEVICES entries."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_vlm.callbacks.vllm import VLLMGeneration, trainer_gpus
from lightning_vlm.serving.server_gpus import gpus_needed, server_gpus


def test_the_server_takes_the_first_gpus_the_trainer_leaves_free():
    assert server_gpus([0], ["0", "1"], 1) == "1"
    assert server_gpus([0, 1], ["0", "1", "2", "3"], 2) == "2,3"
    assert server_gpus([1], ["0", "1", "2"], 1) == "0"


def test_indices_count_the_gpus_this_process_sees():
    # CUDA_VISIBLE_DEVICES=4,5,6,7: the child must get "6,7", which it reads as physical GPUs 6 and 7
    # (a child given "2,3" would take physical GPUs 2 and 3, another job's).
    visible = ["4", "5", "6", "7"]
    assert server_gpus([0, 1], visible, 2) == "6,7"
    assert server_gpus([0], visible, 1, chosen=[3]) == "7"
    uuids = ["GPU-aaa", "GPU-bbb"]
    assert server_gpus([0], uuids, 1) == "GPU-bbb"


@pytest.mark.parametrize(
    ("trainer", "visible", "count", "chosen", "match"),
    [
        (
            [0],
            ["0"],
            1,
            None,
            r"needs 1 GPU\(s\) the trainer does not use, and the trainer uses \[0\] of the 1",
        ),
        ([0, 1], ["0", "1", "2"], 2, None, r"generation=vllm_colocate"),
        ([0, 1], ["0", "1", "2"], 1, [1], r"server_devices=\[1\] shares GPU\(s\) \[1\] with the trainer"),
        ([0], ["0", "1"], 1, [2], r"sees 2 GPU\(s\) \(indices 0-1\), not \[2\]"),
        (
            [0],
            ["0", "1", "2"],
            1,
            [1, 2],
            r"names 2 GPU\(s\), and the server takes 1 \(engine.tensor_parallel_size",
        ),
    ],
)
def test_overlapping_missing_or_too_few_gpus_are_refused_naming_the_settings(
    trainer, visible, count, chosen, match
):
    with pytest.raises(ValueError, match=match):
        server_gpus(trainer, visible, count, chosen)


def test_the_started_server_gets_them_in_its_environment():
    callback = VLLMGeneration(mode="server", start_server=True, api_key="k", server_devices=[1])
    assert callback.server_env("7") == {"VLLM_API_KEY": "k", "CUDA_VISIBLE_DEVICES": "7"}
    assert callback.server_env() == {"VLLM_API_KEY": "k"}  # a CPU trainer: nothing to place
    with pytest.raises(ValueError, match=r"server_devices places the server this callback starts"):
        VLLMGeneration(mode="server", server_devices=[1])
    with pytest.raises(
        ValueError, match=r"server_args=\['--max-model-len', '512'\] are options of the server this"
    ):
        VLLMGeneration(mode="server", server_args=["--max-model-len", "512"])  # a server started by hand


def test_the_server_counts_every_parallel_size_of_its_options():
    # server_args' --pipeline-parallel-size and --data-parallel-size, and a second --tensor-parallel-size
    # (argparse keeps the last), were not counted: the server got too few GPUs and failed in its own log.
    callback = VLLMGeneration(mode="server", start_server=True, engine={"tensor_parallel_size": 2},
                              server_args=["--pipeline-parallel-size", "2", "-dp=2"])  # fmt: skip
    assert gpus_needed(callback._server_cli_args()) == 8
    assert gpus_needed(["--tensor-parallel-size", "2", "--tensor-parallel-size=4"]) == 4
    assert gpus_needed(["--max-model-len", "512"]) == 1
    with pytest.raises(ValueError, match=r"--data-parallel-size takes a whole number, got 'x'"):
        gpus_needed(["--data-parallel-size", "x"])


def test_the_trainers_gpus_are_its_devices_indices_in_any_order():
    # Lightning's trainer.device_ids gives cuda:0 listed second its position (1): the server then took GPU 0.
    ddp = DDPStrategy(parallel_devices=[torch.device("cuda", 2), torch.device("cuda", 0)])
    assert trainer_gpus(SimpleNamespace(strategy=ddp)) == [2, 0]  # trainer_gpus reads the strategy only
    assert trainer_gpus(SimpleNamespace(strategy=SingleDeviceStrategy(torch.device("cuda", 1)))) == [1]
    assert trainer_gpus(L.Trainer(accelerator="cpu", devices=1, logger=False)) == []
