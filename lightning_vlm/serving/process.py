"""Starting and stopping ``python -m lightning_vlm.serve`` as a subprocess (tests, ``start_server=true``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


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
    full_env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **(env or {})}
    # Its own session: stopping it reaches vLLM's engine-core child too. Its own session also means
    # no SIGHUP when the trainer dies: the kernel sends SIGTERM instead (a killed trainer frees the GPU).
    proc = subprocess.Popen([*cmd, *(args or [])], stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, preexec_fn=_terminate_with_parent)  # fmt: skip
    if log_path:
        out.close()  # the child holds its own descriptor
    return proc, f"http://{host}:{port}"


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``; strictly,
    when the thread that started it exits: start servers from a thread that lives as long as they)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: the server outlives a killed trainer, as any process would
        pass


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
