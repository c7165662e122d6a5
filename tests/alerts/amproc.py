"""A real Alertmanager process for the tests that compare kvpilot with it.

Needs `prometheus-alertmanager` (Debian package of that name) or `alertmanager` on PATH; skipped without
it, failed without it when KVPILOT_REQUIRE_ALERTMANAGER=1 (CI). Loopback only, bounded waits, the
process is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from alerts.sink import Received, WebhookSink

EXTERNAL_URL = "http://localhost:9093"


def alertmanager_binary() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if found is None:
        reason = (
            "no Alertmanager binary (install the Debian package prometheus-alertmanager, or put `alertmanager` on PATH)"
        )
        if os.environ.get("KVPILOT_REQUIRE_ALERTMANAGER") == "1":
            pytest.fail(f"KVPILOT_REQUIRE_ALERTMANAGER=1 but {reason}")
        pytest.skip(reason)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_alertmanager(tmp_path: Path, config_text: str, external_url: str = EXTERNAL_URL) -> Iterator[str]:
    """Start Alertmanager on `config_text` (YAML, or JSON, which is YAML too); yields its base URL."""
    binary = alertmanager_binary()
    config = tmp_path / "alertmanager.yml"
    config.write_text(config_text, encoding="utf-8")
    port = _free_port()
    log_path = tmp_path / "alertmanager.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.path={tmp_path / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                f"--web.external-url={external_url}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"alertmanager exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"alertmanager not ready on {url} after 20 s:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_received(sink: WebhookSink, match: Callable[[Any], bool], timeout_s: float = 15.0) -> Received:
    """The first notification whose parsed payload `match`es, waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for received in list(sink.received):
            if match(received.payload):
                return received
        sink.wait_for(len(sink.received) + 1, 0.1)
    raise AssertionError(f"no matching notification within {timeout_s} s; got {[r.payload for r in sink.received]}")
