"""Child processes the project starts (a collector, an engine, the dashboard, a vLLM, Alertmanager in tests):
started with their output in a log file, waited on until their health endpoint answers, stopped.

`wait_healthy` fails fast when the child exits before it serves and names the tail of its log either way,
so a failed start says why without anyone opening the log. On a thread of its own it can wait without a
deadline (`timeout_s=math.inf`) until a stop event gives up for it. `stop_process` is SIGTERM, then SIGKILL after a
grace period; it always reaps the child.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 2000


class ProcessStartError(RuntimeError):
    """A child that exited before serving, or did not answer its health endpoint in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(
    command: Sequence[str],
    *,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    new_session: bool = False,
) -> subprocess.Popen:
    """Start `command` with stdin closed and stdout and stderr appended to `log_path` (dropped without one).

    `new_session`: the child leads its own process group, so a signal to the group reaches its children too.
    """
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=new_session,
        )
    finally:
        if not isinstance(out, int):
            out.close()


def log_tail(log_path: str | os.PathLike | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of the log ("" without one, or when it cannot be read)."""
    if not log_path:
        return ""
    try:
        return Path(log_path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None,
    *,
    timeout_s: float,
    what: str = "child process",
    log_path: str | os.PathLike | None = None,
    poll_s: float = 0.1,
    stop: threading.Event | None = None,
) -> bool:
    """Poll `url` (a health endpoint) until it answers 200 (True); raise ProcessStartError when `proc` exits
    first or `timeout_s` passes, with the tail of `log_path`; False when `stop` is set first. The caller stops
    the child on failure."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    pause = stop or threading.Event()  # without a stop, never set: a plain sleep between polls
    with httpx.Client(timeout=2.0) as client:
        while not pause.is_set():
            if proc is not None and proc.poll() is not None:
                raise ProcessStartError(_with_tail(f"{what} exited with {proc.returncode} before serving", log_path))
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return True
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = str(exc) or type(exc).__name__
            if time.monotonic() > deadline:
                message = f"{what} did not answer {url} within {timeout_s:.0f} s ({last})"
                raise ProcessStartError(_with_tail(message, log_path))
            pause.wait(poll_s)
    return False


def _with_tail(message: str, log_path: str | os.PathLike | None) -> str:
    tail = log_tail(log_path)
    return f"{message}:\n{tail}" if tail else message


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within `timeout_s`; reaps it either way."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
