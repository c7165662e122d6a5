"""A real Alertmanager process for the tests that compare kvpilot with it.

Needs `prometheus-alertmanager` (Debian package of that name) or `alertmanager` on PATH; skipped without
it, failed without it when KVPILOT_REQUIRE_ALERTMANAGER=1 (CI). Loopback only, bounded waits, the
process is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from alerts.sink import Received, WebhookSink
from plumbing.process import ProcessStartError, free_port, spawn, stop_process, wait_healthy

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


@contextmanager
def run_alertmanager(tmp_path: Path, config_text: str, external_url: str = EXTERNAL_URL) -> Iterator[str]:
    """Start Alertmanager on `config_text` (YAML, or JSON, which is YAML too); yields its base URL."""
    binary = alertmanager_binary()
    config = tmp_path / "alertmanager.yml"
    config.write_text(config_text, encoding="utf-8")
    port = free_port()
    log_path = tmp_path / "alertmanager.log"
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        f"--web.external-url={external_url}",
        "--log.level=warn",
    ]
    proc = spawn(command, log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(f"{url}/-/ready", proc, timeout_s=20, what="alertmanager", log_path=log_path, poll_s=0.05)
        except ProcessStartError as exc:
            pytest.fail(str(exc))
        yield url
    finally:
        stop_process(proc, 5)


def wait_received(sink: WebhookSink, match: Callable[[Any], bool], timeout_s: float = 15.0) -> Received:
    """The first notification whose parsed payload `match`es, waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for received in list(sink.received):
            if match(received.payload):
                return received
        sink.wait_for(len(sink.received) + 1, 0.1)
    raise AssertionError(f"no matching notification within {timeout_s} s; got {[r.payload for r in sink.received]}")
