"""Just enough of the Chrome DevTools Protocol to load a Streamlit page, wait until it finished, and screenshot it.

One headless chromium serves every page (a launch per page costs seconds). Waiting is on the page's own state
(the expected text present, Streamlit's "running" widget gone, charts drawn) rather than on a fixed sleep, so
a slow CI machine takes longer instead of producing screenshots of the loading skeleton.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


class Page:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def load(self, url: str, *, expect: str, timeout_s: float = 60.0) -> str:
        """Navigate and wait until `expect` is on the page, the script run is over and charts are drawn.

        Returns the page's visible text (for assertions on what a reader sees).
        """
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] = {}
        stable = 0
        while time.monotonic() < deadline:
            state = (
                self.evaluate(
                    "({text: document.body ? document.body.innerText : '',"
                    " running: !!document.querySelector('[data-testid=\"stStatusWidget\"]'),"
                    " skeleton: !!document.querySelector('[data-testid=\"stSkeleton\"]'),"
                    " charts: document.querySelectorAll('.vega-embed').length,"
                    " drawn: document.querySelectorAll('.vega-embed canvas, .vega-embed svg').length})"
                )
                or {}
            )
            ready = (
                expect in state.get("text", "")
                and not state.get("running")
                and not state.get("skeleton")
                and state.get("drawn", 0) >= state.get("charts", 0)
            )
            stable = stable + 1 if ready else 0
            if stable >= 3:  # ready on three polls in a row: nothing is still arriving
                time.sleep(0.5)  # let vega finish its transition frame
                return self.evaluate("document.body.innerText")
            time.sleep(0.25)
        flags = {k: v for k, v in state.items() if k != "text"}
        raise TimeoutError(
            f"{url}: not ready after {timeout_s:.0f} s (expected {expect!r}); state: {flags}; "
            f"text: {state.get('text', '')[:500]!r}"
        )

    def screenshot(self, target: Path, *, width: int, height: int, full: bool = True) -> None:
        """A PNG of the page; `full` grows the viewport to the scrolled content (Streamlit scrolls a div)."""
        tall = height
        if full:
            content = self.evaluate(
                "Math.max(...[...document.querySelectorAll('[data-testid=\"stMain\"], section.main, .main')]"
                ".map(e => e.scrollHeight), document.body.scrollHeight)"
            )
            tall = max(height, min(int(content or height) + 40, 8000))
        if tall != height:
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=tall, deviceScaleFactor=1, mobile=False)
            time.sleep(1.0)  # charts re-layout to the new size
        data = self.call("Page.captureScreenshot", format="png")["data"]
        target.write_bytes(base64.b64decode(data))
        if tall != height:
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )


@contextlib.contextmanager
def chromium_page(binary: str, profile: Path, *, width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A headless chromium (the Debian package's flags) with one page, driven over DevTools."""
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a stale one names a dead browser's port
    proc = subprocess.Popen(
        [
            binary,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start its DevTools endpoint (exit {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = []
        while not targets:
            targets = [
                t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json() if t.get("type") == "page"
            ]
            if time.monotonic() > deadline:
                raise RuntimeError("chromium has no page target")
            time.sleep(0.1)
        with connect(targets[0]["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10) as ws:
            page = Page(ws)
            page.call("Page.enable")
            page.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
