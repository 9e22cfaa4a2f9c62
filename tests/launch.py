"""``torchrun`` for tests: one torch thread per process, and a launch past its timeout says where it hung."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from helpers import ROOT

# Seconds the processes get to write their stacks (faulthandler) before they are killed.
STACK_DUMP_WAIT = 5.0


def torchrun(
    script: Path, args: list[str], nproc: int = 2, timeout: float = 1200
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=N script args`` with one torch thread per process.

    On timeout every process it started gets SIGABRT first: with ``PYTHONFAULTHANDLER`` set, each
    writes every thread's Python stack to its stderr (a vLLM server to its log), so a hang that CI
    met once says where it was. Then the whole process group is killed (torchrun's workers too,
    which would otherwise outlive it and load the machine), and the result has return code -9.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun gives each worker a session of its own: kill them too, or they hold the pipes open
        children = psutil.Process(proc.pid).children(recursive=True)
        _signal(children, signal.SIGABRT)
        psutil.wait_procs(children, timeout=STACK_DUMP_WAIT)
        _signal([*psutil.Process(proc.pid).children(recursive=True), *children], signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[torchrun killed after {timeout:g} s; the stacks above are where its processes were]"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
