"""The default process group is shut down at a normal exit (parallel/teardown.py), for gloo too, after
the exit handlers registered later and before those registered earlier: checked in a real process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from lightning_vlm.parallel.teardown import shut_down_at_exit

    atexit.register(lambda: print("registered before:", dist.is_initialized(), flush=True))
    shut_down_at_exit()
    shut_down_at_exit()  # once per process, however often a run calls it
    store = dist.FileStore(sys.argv[1], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    atexit.register(lambda: print("registered after:", dist.is_initialized(), flush=True))
    """
)


def test_the_gloo_group_is_shut_down_at_exit_in_the_handlers_order(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # last in, first out: a later handler (Lightning's, vLLM's) still sees the group, an earlier one not
    assert done.stdout.splitlines() == ["registered after: True", "registered before: False"]
