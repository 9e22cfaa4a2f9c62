"""Shut the default process group down at a normal program exit, whatever its backend.

Lightning registers this teardown for NCCL only (PyTorch >= 2.4 asks for it); a gloo group is left to
the interpreter's shutdown, where its C++ threads and connections are torn down with whatever still
holds them. Once in CI a rank of a 2-process CPU sweep under torchrun aborted after its last job
("terminate called without an active exception", SIGABRT), failing a run whose jobs had all finished;
it did not recur in 21 reruns, so this is hardening, not a proven cure. ``destroy_process_group``
from an ``atexit`` handler shuts every backend down in order while the interpreter is still whole.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def shut_down_at_exit() -> None:
    """Register (once per process) the shutdown of the default process group at interpreter exit.

    Call it before the group exists: ``atexit`` runs handlers last-in first-out, so those registered
    later (Lightning's, vLLM's engine shutdown) still run while the group is up.
    """
    global _registered
    if not _registered:
        atexit.register(shut_down)
        _registered = True


def shut_down() -> None:
    """Destroy the default process group (and every other) if one exists; a no-op otherwise."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
