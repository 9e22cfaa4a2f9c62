"""Which GPUs a vLLM server started by the trainer (``start_server=true``) runs on.

The server inherited the trainer's environment, so vLLM took the first GPUs it saw: rank 0's, where it
then claimed ``gpu_memory_utilization`` (0.9) of a GPU the trainer was using. Here it gets GPUs the
trainer does not use: the ones named in ``server_devices``, else the first free ones. Indices count the
GPUs this process sees, as ``trainer.devices`` does, and are turned into the entries of the trainer's own
``CUDA_VISIBLE_DEVICES`` (a child's indices would otherwise be read against the physical list).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

ONE_GPU_ADVICE = (
    "on a single GPU, generate in-process with generation=vllm_colocate (its engine shares the trainer's "
    "GPU by design), or start the server by hand with a smaller --gpu-memory-utilization"
)


# vLLM's options for the parallel sizes whose product is the GPUs a server takes (argparse keeps the last).
_PARALLEL_OPTIONS = {
    "--tensor-parallel-size": "tp", "-tp": "tp",
    "--pipeline-parallel-size": "pp", "-pp": "pp",
    "--data-parallel-size": "dp", "-dp": "dp",
}  # fmt: skip


def gpus_needed(server_args: Sequence[str]) -> int:
    """The GPUs a server started with ``server_args`` takes: tensor × pipeline × data parallel sizes."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for i, arg in enumerate(server_args):
        name, _, value = arg.partition("=")
        if name in _PARALLEL_OPTIONS:
            if not value and i + 1 < len(server_args):
                value = server_args[i + 1]
            try:
                sizes[_PARALLEL_OPTIONS[name]] = int(value)
            except ValueError:
                raise ValueError(f"server option {name} takes a whole number, got {value!r}") from None
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as ``CUDA_VISIBLE_DEVICES`` entries (ids or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def server_gpus(
    trainer_gpus: Sequence[int], visible: Sequence[str], count: int, chosen: Sequence[int] | None = None
) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a started server that needs ``count`` GPUs (:func:`gpus_needed`),
    next to a trainer on ``trainer_gpus`` (indices into ``visible``): ``chosen`` ones (``server_devices``),
    else the first ones the trainer leaves free. ``ValueError`` naming the settings when they overlap the
    trainer's, are not there, or are too few."""
    trainer = sorted(set(trainer_gpus))
    if chosen is not None:
        chosen = [int(i) for i in chosen]
        missing = [i for i in chosen if not 0 <= i < len(visible)]
        if missing:
            raise ValueError(
                f"callbacks.vllm_generation.server_devices={chosen}: this process sees {len(visible)} GPU(s) "
                f"(indices 0-{len(visible) - 1}), not {missing}"
            )
        shared = sorted(set(chosen) & set(trainer))
        if shared:
            raise ValueError(
                f"callbacks.vllm_generation.server_devices={chosen} shares GPU(s) {shared} with the trainer "
                f"(devices {trainer}), where the server would claim engine.gpu_memory_utilization of their "
                f"memory: give each its own GPUs (e.g. trainer.devices={trainer[:1]}), or {ONE_GPU_ADVICE}"
            )
        if len(chosen) != count:
            raise ValueError(
                f"callbacks.vllm_generation.server_devices={chosen} names {len(chosen)} GPU(s), and the "
                f"server takes {count} (engine.tensor_parallel_size times the pipeline and data parallel "
                "sizes of server_args): make them agree"
            )
        return ",".join(visible[i] for i in chosen)
    free = [i for i in range(len(visible)) if i not in trainer]
    if len(free) < count:
        raise ValueError(
            f"a started vLLM server (start_server=true) needs {count} GPU(s) the trainer does not use, and "
            f"the trainer uses {trainer} of the {len(visible)} this process sees: leave GPUs to the server "
            f"(trainer.devices) or set callbacks.vllm_generation.server_devices; {ONE_GPU_ADVICE}"
        )
    return ",".join(visible[i] for i in free[:count])
