"""`start_dashboard` (what the demo uses) serves the app on its port and stops when terminated."""

from __future__ import annotations

import httpx

from kvpilot.cli_dashboard import HEALTH_PATH, dashboard_url, start_dashboard
from plumbing.process import free_port, wait_healthy


def test_start_dashboard_serves_and_stops(sqlite_url: str, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = start_dashboard(sqlite_url, port, log_path=log)
    try:
        base = dashboard_url("127.0.0.1", port)
        wait_healthy(base + HEALTH_PATH, proc, timeout_s=90, what="dashboard", log_path=log)
        page = httpx.get(f"{base}/", timeout=10)
        assert page.status_code == 200 and "<noscript>" in page.text  # Streamlit's app shell
        assert f"127.0.0.1:{port}" in log.read_text()  # Streamlit announces the address it serves
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) is not None
