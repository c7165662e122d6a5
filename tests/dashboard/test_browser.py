"""A real `kvpilot dashboard` on a seeded database, every page loaded by Debian's headless chromium.

Screenshots land in build/screenshots/ (CI keeps them as artifacts). Without chromium on PATH the test is
skipped with the reason; with KVPILOT_REQUIRE_CHROMIUM=1 (CI) a missing chromium fails it instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.cli_dashboard import HEALTH_PATH, dashboard_url
from plumbing.process import ProcessStartError, free_port, wait_healthy
from tests.dashboard.cdp import chromium_page
from tests.dashboard.seed import seed_database
from tests.dashboard.seed_sim import SIM, add_simulated_and_spike

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "build" / "screenshots"
# Every page by its own URL; "" is the root, which opens the overview too.
PAGES = ("", "overview", "latency", "kv-memory", "diagnosis", "alerts", "tuning", "targets")
# Text the last section of each page shows: the page ran to its end.
EXPECTED_TEXT = {
    "": "Accelerator utilization",
    "overview": "Accelerator utilization",
    "latency": "Slowest requests",
    "kv-memory": "Allocation trace",
    "diagnosis": "Studies started with these commands",
    "alerts": "New silence",
    "tuning": "Proposal #2",
    "targets": "Scrape history",
}
# Numbers and names from the seeded data that a reader must see (tests/dashboard/seed.py); outside tables,
# which draw on a canvas.
# The seed has the tuner's simulated runs and a KV spike to 100% too (seed_sim.py): neither may mislead.
SHOWN = {
    "": ["101", "KvCacheNearlyFull", "All times are UTC"],
    "overview": ["101", "KvCacheNearlyFull", "over 10 min with traffic"],
    "latency": ["3.71 s", "Where the time goes"],
    "kv-memory": ["100.0%", "Alloc retries"],
    "diagnosis": ["Traps present", "The memory wall", "kvpilot tune study --knob"],
    "alerts": ["failed: 1 · delivered: 1", "HighTTFT", "Resolved", "Rules in"],
    "tuning": ["Objectives: ttft_p99_s (minimize)", "max_num_seqs"],
    "targets": ["connection refused", "vllm-a"],
}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _ink(png: Path, box: tuple[int, int, int, int] | None = None) -> float:
    """Fraction of clearly dark pixels (in `box`, left-top-right-bottom, if given): text and chart lines. A
    loading skeleton, a blank page or a table that drew no cells has ~0."""
    from PIL import Image

    with Image.open(png) as img:
        hist = (img.crop(box) if box else img).convert("L").histogram()
    return sum(hist[:160]) / max(1, sum(hist))


# Tables draw their cells on a canvas: where a page has one, the box of its first must hold ink (text), not be
# an empty frame. The targets table lists the seeded targets (tests/dashboard/seed.py).
TABLE_BOX = (
    "JSON.stringify((r => [r.left, r.top, r.right, r.bottom])"
    "(document.querySelector('[data-testid=\"stDataFrame\"]').getBoundingClientRect()))"
)
TABLE_PAGES = ("targets", "alerts", "diagnosis")


@pytest.fixture
def chromium() -> str:
    binary = _chromium()
    if binary is None:
        reason = "chromium not on PATH (Debian: apt-get install -y chromium)"
        if os.environ.get("KVPILOT_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"KVPILOT_REQUIRE_CHROMIUM=1 but {reason}")
        pytest.skip(reason)
    return binary


@pytest.mark.timeout(240)
def test_every_page_renders_in_chromium(chromium: str, sqlite_url: str, tmp_path: Path) -> None:
    seed_database(sqlite_url)
    add_simulated_and_spike(sqlite_url)
    port = free_port()
    base = dashboard_url("127.0.0.1", port)
    log = tmp_path / "dashboard.log"
    # The real command, as an engineer types it (the console script; `python -m kvpilot.cli` where absent).
    script = Path(sys.executable).with_name("kvpilot")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "kvpilot.cli"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cli, "dashboard", "--db-url", sqlite_url, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        try:
            wait_healthy(base + HEALTH_PATH, proc, timeout_s=90, what="dashboard", log_path=log)
        except ProcessStartError as exc:
            pytest.fail(str(exc))
        SHOTS.mkdir(parents=True, exist_ok=True)
        problems = []
        with chromium_page(chromium, tmp_path / "chromium-profile") as page:
            for name in PAGES:
                target = SHOTS / f"{name or 'root'}.png"
                target.unlink(missing_ok=True)
                try:
                    text = page.load(f"{base}/{name}", expect=EXPECTED_TEXT[name])
                except TimeoutError as exc:
                    problems.append(str(exc))
                    continue
                page.screenshot(target, width=1400, height=1000)
                problems += [f"{name}: {want!r} not shown" for want in SHOWN[name] if want not in text]
                if "Traceback" in text or "Error:" in text or "Page not found" in text:
                    problems.append(f"{name}: the page shows an error: {text[:400]!r}")
                shown_sim = [line for line in text.splitlines() if SIM in line and "left out" not in line.lower()]
                if shown_sim:  # only where the page says it is left out
                    problems.append(f"{name}: the simulator's instance is shown: {shown_sim}")
                if name in TABLE_PAGES:
                    box = tuple(round(v) for v in json.loads(page.evaluate(TABLE_BOX)))
                    if box[2] - box[0] < 100 or box[3] - box[1] < 60 or _ink(target, box) < 0.01:
                        problems.append(f"{name}: the first table drew nothing in {box}")
                ink = _ink(target)
                if target.stat().st_size < 20_000 or ink < 0.004:
                    problems.append(f"{name}: screenshot looks blank ({target.stat().st_size} bytes, ink {ink:.4f})")
        assert not problems, "\n".join(problems) + f"\n--- dashboard log ---\n{log.read_text()[-3000:]}"
    finally:
        proc.terminate()  # `kvpilot dashboard` passes SIGTERM on to Streamlit
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert _stops_answering(base), "Streamlit kept serving after `kvpilot dashboard` was stopped"


def _stops_answering(base: str, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/_stcore/health", timeout=1.0)
        except httpx.HTTPError:
            return True
        time.sleep(0.2)
    return False
