"""A collector in a child process (`python -m collector serve`), for load tests, benchmarks and kill -9 tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from collector.errors import CollectorError
from collector.settings import CollectorSettings


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within `timeout_s`; reaps it either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class CollectorProcess:
    """A collector in a child process (`python -m collector serve`); kill() is a real SIGKILL."""

    url: str
    port: int
    proc: subprocess.Popen

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_subprocess(
    settings: CollectorSettings, *, timeout_s: float = 30.0, log_path: str | os.PathLike | None = None
) -> CollectorProcess:
    """Run a collector in a child process on settings.port (0: a free port); returns once /health answers."""
    port = settings.port or free_port(settings.host)
    env = {**os.environ}
    for name, value in settings.model_dump(mode="json").items():
        key = f"KVPILOT_{name.upper()}"
        if value is None:
            env.pop(key, None)
        elif isinstance(value, list):
            env[key] = ",".join(str(v) for v in value)  # KVPILOT_SCRAPE_ALLOW_NETS' form
        elif isinstance(value, dict):
            env[key] = json.dumps(value)
        else:
            env[key] = str(value)
    env["KVPILOT_PORT"] = str(port)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve"], env=env, stdout=out, stderr=out)
    url = f"http://{settings.host}:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise CollectorError(f"collector exited with {proc.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return CollectorProcess(url=url, port=port, proc=proc)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise CollectorError(f"collector did not answer on {url} within {timeout_s}s")
        time.sleep(0.05)
