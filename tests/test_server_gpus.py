"""The GPUs a vLLM server started by the trainer runs on: never the trainer's (it inherited them, and claimed
0.9 of rank 0's memory), named in the trainer's own CUDA_VISIBLE_DEVICES entries."""

from __future__ import annotations

import pytest

from lightning_vlm.callbacks.vllm import VLLMGeneration
from lightning_vlm.serving.server_gpus import server_gpus


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
            r"names 2 GPU\(s\), and the server's engine.tensor_parallel_size is 1",
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
