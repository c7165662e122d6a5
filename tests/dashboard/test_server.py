"""`start_dashboard` (what the demo uses) serves the app on its port and stops when terminated."""

from __future__ import annotations

import socket

import httpx

from kvpilot.cli_dashboard import dashboard_url, start_dashboard, wait_until_healthy


def test_start_dashboard_serves_and_stops(sqlite_url: str, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "dashboard.log"
    proc = start_dashboard(sqlite_url, port, log_path=log)
    try:
        base = dashboard_url("127.0.0.1", port)
        wait_until_healthy(base, timeout_s=90, proc=proc)
        page = httpx.get(f"{base}/", timeout=10)
        assert page.status_code == 200 and "<noscript>" in page.text  # Streamlit's app shell
        assert f"127.0.0.1:{port}" in log.read_text()  # Streamlit announces the address it serves
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) is not None
