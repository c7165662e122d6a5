"""A collector in a child process (`python -m collector serve`), for load tests, benchmarks and kill -9 tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from collector.errors import CollectorError
from collector.settings import CollectorSettings
from plumbing.process import ProcessStartError, free_port, spawn, stop_process, wait_healthy


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


def _env(settings: CollectorSettings, port: int) -> dict[str, str]:
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
    return env


def start_subprocess(
    settings: CollectorSettings, *, timeout_s: float = 30.0, log_path: str | os.PathLike | None = None
) -> CollectorProcess:
    """Run a collector in a child process on settings.port (0: a free port); returns once /health answers."""
    port = settings.port or free_port(settings.host)
    proc = spawn([sys.executable, "-m", "collector", "serve"], log_path=log_path, env=_env(settings, port))
    url = f"http://{settings.host}:{port}"
    try:
        wait_healthy(f"{url}/health", proc, timeout_s=timeout_s, what="collector", log_path=log_path, poll_s=0.05)
    except ProcessStartError as exc:
        proc.kill()
        proc.wait()
        raise CollectorError(str(exc)) from None
    return CollectorProcess(url=url, port=port, proc=proc)
