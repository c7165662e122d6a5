"""A child is waited on until its health endpoint answers; an early exit or a timeout names the log's tail."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from plumbing.process import ProcessStartError, free_port, spawn, stop_process, wait_healthy

SERVER = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_waits_until_healthy_then_stops(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "child.log"
    proc = spawn([sys.executable, "-c", SERVER, str(port)], log_path=log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=30, what="child")
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert "serving" in log.read_text()
    finally:
        stop_process(proc)
    assert proc.returncode is not None


def test_an_early_exit_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = spawn([sys.executable, "-c", "import sys; print('bad config: port'); sys.exit(3)"], log_path=log)
    t0 = time.monotonic()
    with pytest.raises(ProcessStartError, match=r"(?s)child exited with 3 before serving:\nbad config: port"):
        wait_healthy(f"http://127.0.0.1:{free_port()}/health", proc, timeout_s=60, what="child", log_path=log)
    assert time.monotonic() - t0 < 30


def test_no_answer_in_time_is_an_error(tmp_path: Path) -> None:
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ProcessStartError, match=r"child did not answer http://127\.0\.0\.1:\d+/health within 1 s"):
            wait_healthy(f"http://127.0.0.1:{free_port()}/health", proc, timeout_s=1, what="child")
    finally:
        stop_process(proc)


def test_a_wait_without_deadline_gives_up_when_stopped() -> None:
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{free_port()}/health"  # nobody answers
    assert wait_healthy(url, None, timeout_s=math.inf, poll_s=0.05, stop=stop) is False
    assert time.monotonic() - t0 < 10


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    ignore = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", ignore], log_path=log)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:  # the handler is installed
        time.sleep(0.05)
    stop_process(proc, timeout_s=0.5)
    assert proc.returncode == -9
