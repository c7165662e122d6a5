"""`kvpilot vllm serve` passes vLLM's output and exit code through when vLLM refuses its arguments, and
takes its scrape target away when it is stopped cleanly.

The session's vLLM (tests/vllm/test_live.py) covers a serving run and a SIGTERM ending in exit code 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from collector.db import make_engine
from collector.queries import engine_infos
from tests.vllm.peer import ADMIN_TOKEN, INSTANCE, REPO, start_peer, stop_peer, vllm_python

pytestmark = pytest.mark.vllm


def test_vllm_refusing_its_arguments_is_its_exit_code_and_its_message(tmp_path: Path) -> None:
    python = vllm_python()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [
        sys.executable, "-m", "kvpilot.cli", "vllm", "serve", "--vllm-python", python,
        "--collector", "http://127.0.0.1:9", "--spool-dir", str(tmp_path / "spool"), "--instance", "broken",
        "--", "--model", str(tmp_path), "--dtype", "nonsense",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, timeout=120, cwd=tmp_path)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err[-2000:]
    assert "argument --dtype: invalid choice: 'nonsense'" in err  # vLLM's own words, passed through
    assert "kvpilot: vLLM exited with 2; 0 iteration lines, 0 steps" in err


def test_a_clean_stop_deletes_the_scrape_target(tmp_path: Path, _sqlite_template: Path) -> None:
    """SIGTERM to `kvpilot vllm serve`: vLLM exits by the signal it was forwarded, and its /metrics target
    leaves the collector, so ScrapeTargetDown does not page for an engine that was shut down."""
    peer = start_peer(tmp_path, _sqlite_template)  # returns once vLLM serves and its target is registered
    try:
        targets = f"{peer.collector_url}/v1/targets"
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert [t["url"] for t in httpx.get(targets, headers=auth).json()] == [f"{peer.url}/metrics"]
        # Its scraped cache_config_info tells the dashboard's advice this is a vLLM and whether it caches prefixes.
        said = _prefix_caching_on(httpx.get(f"{peer.url}/metrics").text)
        db, deadline = make_engine(peer.db_url), time.monotonic() + 30
        while (info := engine_infos(db, instances=[INSTANCE])[INSTANCE]).prefix_caching is None:
            assert time.monotonic() < deadline, (info, peer.where())
            time.sleep(0.5)
        db.dispose()
        assert (info.engine, info.prefix_caching) == ("vllm", said)
        peer.proc.send_signal(signal.SIGTERM)
        assert peer.proc.wait(timeout=90) == 0, peer.kvpilot_log.read_text(errors="replace")[-3000:]
        assert httpx.get(targets, headers=auth).json() == []
        assert "scrape target" in peer.kvpilot_log.read_text() and "deleted" in peer.kvpilot_log.read_text()
    finally:
        stop_peer(peer)


def test_a_crash_keeps_the_scrape_target(tmp_path: Path, _sqlite_template: Path) -> None:
    """vLLM killed by nobody's request (the OOM killer's SIGKILL): its target stays, so ScrapeTargetDown pages."""
    peer = start_peer(tmp_path, _sqlite_template)
    try:
        found = re.search(rb"started vLLM \(pid (\d+)\)", peer.kvpilot_log.read_bytes())
        assert found, peer.where()
        os.killpg(int(found[1]), signal.SIGKILL)  # vLLM's whole process group, not its launcher
        assert peer.proc.wait(timeout=90) == 128 + signal.SIGKILL, peer.where()
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        listed = httpx.get(f"{peer.collector_url}/v1/targets", headers=auth).json()
        assert [t["url"] for t in listed] == [f"{peer.url}/metrics"]
        assert "its scrape target stays registered" in peer.kvpilot_log.read_text()
    finally:
        stop_peer(peer)


def _prefix_caching_on(exposition: str) -> bool:
    """What vLLM's own /metrics says: `vllm:cache_config_info{...,enable_prefix_caching="True",...} 1.0`."""
    line = next(x for x in exposition.splitlines() if x.startswith("vllm:cache_config_info{"))
    return 'enable_prefix_caching="True"' in line
