"""Starting and stopping ``python -m lightning_vlm.serve`` as a subprocess (tests, ``start_server=true``)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)
# The pid of the process that started a server: the server stops when it dies (stop_with_parent).
STOP_WITH_PID = "LIGHTNING_VLM_STOP_WITH_PID"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(
    model: str, port: int | None = None, host: str = "127.0.0.1", args: list[str] | None = None,
    log_path: str | None = None, env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Start the server in a subprocess; returns (process, url). Not waited for (poll ``/health``)."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "lightning_vlm.serve", str(model), "--host", host, "--port", str(port)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    full_env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **(env or {}),
                STOP_WITH_PID: str(os.getpid())}  # fmt: skip
    # Its own session: stopping it reaches vLLM's engine-core child too. Its own session also means
    # no SIGHUP when the trainer dies: the server asks the kernel for SIGTERM instead (stop_with_parent),
    # so a killed trainer frees the GPU. Not a preexec_fn: Python code between fork and exec can
    # deadlock in a process with threads (the trainer has many: gloo, data loaders, loggers).
    proc = subprocess.Popen([*cmd, *(args or [])], stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)  # fmt: skip
    if log_path:
        out.close()  # the child holds its own descriptor
    return proc, f"http://{host}:{port}"


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``/health`` in time; the message has its log's last lines."""


def launch_server(
    model: str, args: list[str], log_path: str | Path, wait: float, healthy: Callable[[str], bool],
    attempts: int = 3, poll: float = 1.0, env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Start the server on a free port and wait until ``healthy(url)``; returns (process, url).

    Its output goes to ``log_path`` (appended); ``env`` is added to this process's environment. A server
    that exits while loading fails at once with its log's tail, not after ``wait`` seconds. The port is
    free when picked but only bound once vLLM has imported (seconds later), so another process can take
    it in between: that exit is retried on a new port, ``attempts`` times in all.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        # This attempt's lines only: the log is appended to (earlier attempts, earlier runs).
        start = log_path.stat().st_size if log_path.exists() else 0
        proc, url = start_server(model, args=args, log_path=str(log_path), env=env)
        try:
            retry = _wait_ready(proc, url, log_path, start, wait, healthy, poll, attempt < attempts)
        except BaseException:
            stop_server(proc)  # never leave a half-started server behind (an error, Ctrl-C)
            raise
        if not retry:
            return proc, url
        stop_server(proc)  # reaps what the exited attempt left (its process group)
        logger.warning("vLLM server: the port of %s was taken before it bound it; retrying on another", url)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _wait_ready(
    proc: subprocess.Popen, url: str, log_path: Path, start: int, wait: float,
    healthy: Callable[[str], bool], poll: float, may_retry: bool,
) -> bool:  # fmt: skip
    """Until ``proc`` answers ``/health``: False when it does; True when it lost its port (retry)."""
    deadline = time.monotonic() + wait
    while True:
        code = proc.poll()
        # A healthy answer counts only while our process lives: one that exited cannot have given it.
        if code is None and healthy(url) and proc.poll() is None:
            return False
        if code is not None:
            tail = log_tail(log_path, start)
            if "Address already in use" in tail and may_retry:
                return True
            raise ServerStartError(f"vLLM server ({url}) exited with code {code} while starting; last "
                                   f"lines of {log_path}:\n{tail}")  # fmt: skip
        if time.monotonic() > deadline:
            raise ServerStartError(f"vLLM server ({url}) did not answer /health within {wait:g} s; last "
                                   f"lines of {log_path}:\n{log_tail(log_path, start)}")  # fmt: skip
        time.sleep(poll)


def log_tail(path: str | Path, start: int = 0, lines: int = 30) -> str:
    """The last ``lines`` lines of a text file from byte ``start`` on ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def stop_with_parent() -> None:
    """In a server ``start_server`` started, first thing: SIGTERM when the process that started it dies
    (Linux ``PR_SET_PDEATHSIG``; strictly, when the thread that started it exits: start servers from a
    thread that lives as long as they). One whose starter died already stops at once."""
    import ctypes
    import signal

    starter = os.environ.pop(STOP_WITH_PID, None)  # vLLM's own children are stopped by vLLM
    if starter is None:  # started by hand: it lives until stopped
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server outlives a killed trainer, as any process would
        return
    if os.getppid() != int(starter):  # died before the request: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM the server's process group (it shuts down cleanly), SIGKILL after ``timeout``; its exit code."""
    import signal

    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
    code = proc.wait(timeout)
    _signal_group(proc, signal.SIGKILL)  # an orphaned engine core must not keep the port or memory
    return code


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL the whole server (API process and engine core): a crash, as tests inject it."""
    import signal

    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
