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

    On timeout the processes write where they were (``stop_with_stacks``) and are killed; the result
    then has return code -9.
    """
    proc = start_torchrun(script, args, nproc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_with_stacks(proc)
        err += f"\n[torchrun killed after {timeout:g} s; the stacks above are where its processes were]"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_torchrun(script: Path, args: list[str], nproc: int = 2) -> subprocess.Popen:
    """The launch ``torchrun`` makes, not waited for (its output piped, as text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def stop_with_stacks(proc: subprocess.Popen) -> tuple[str, str]:
    """Every process ``proc`` started gets SIGABRT first: with ``PYTHONFAULTHANDLER`` set, each writes
    every thread's Python stack to its stderr (a vLLM server to its log), so a hang that CI met once
    says where it was. Then the whole process group is killed (torchrun's workers too, which would
    otherwise outlive it and load the machine). Returns the output (stdout, stderr)."""
    # Stopped first: torchrun would see its workers die, stop the others and exit 1 on its own, so the
    # result would not say "killed" (-9), and the workers would get its SIGTERM while writing stacks.
    os.kill(proc.pid, signal.SIGSTOP)
    # torchrun gives each worker a session of its own: kill them too, or they hold the pipes open
    children = _descendants(proc.pid)
    _signal(children, signal.SIGABRT)
    try:  # read the pipes meanwhile: stacks that filled one would block in faulthandler, cut short
        proc.communicate(timeout=STACK_DUMP_WAIT)  # (the output read so far is kept for the next call)
    except subprocess.TimeoutExpired:
        pass
    _signal(children, signal.SIGKILL)  # a stopped torchrun starts no more
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # torchrun ended just before it was stopped: its session is killed whole
        return []


def _signal(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        try:
            if sig == signal.SIGABRT:  # its stacks, not a core file of gigabytes where core dumps are on
                p.rlimit(psutil.RLIMIT_CORE, (0, 0))
            p.send_signal(sig)
        except psutil.Error:  # gone already, or not ours to limit (it then gets no SIGABRT)
            pass
