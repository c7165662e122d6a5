"""Scrapes of hostile targets: compressed bombs, stacked codings, pages of too many samples.

Each fails (`up` 0) with `last_error` naming the bound, within its deadline, without inflating or parsing
past the bound: 1,830 bytes of stacked gzip once made 2.2 GB every interval.
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import threading
import time
import zlib
from collections.abc import Iterator
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from collector import scraper as scraper_module
from collector.scrapebody import BOUNDS, INFLATE_STEP, MAX_SCRAPE_BYTES, BoundedBody, ScrapeError
from collector.scraper import ScrapeMetrics, Scraper
from tests.collector.test_scrape import LOOPBACK, NOW, add_targets, stored, target_row

PAGE = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"


def bomb(size: int) -> bytes:
    """`size` bytes of a valid page's comment lines, gzipped: about size/1000 on the wire."""
    inflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"#" * ((1 << 20) - 1) + b"\n"
    parts = [inflater.compress(block) for _ in range(size // len(block))]
    return b"".join([*parts, inflater.flush()])


class _Hostile(http.server.BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, tuple[str | None, bytes]]] = {}

    def do_GET(self) -> None:
        coding, body = self.pages[self.path]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        if coding:
            self.send_header("Content-Encoding", coding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    many = b"".join(b'm{i="%d"} 1\n' % i for i in range(5000))
    _Hostile.pages = {
        "/gzip": ("gzip", gzip.compress(PAGE)),
        "/stacked": ("gzip, gzip", gzip.compress(gzip.compress(b"#" * (64 << 20), 9), 9)),
        "/bomb": ("gzip", bomb(64 << 20)),
        "/brotli": ("br", PAGE),
        "/many": (None, many),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hostile_targets_fail_with_the_bound_named(
    db_engine: Engine, hostile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scraper_module, "MIN_PARSE_CAP", 1000)
    errors = {
        "gzip": None,
        "stacked": "more than one content coding",
        "bomb": f"response larger than {MAX_SCRAPE_BYTES} bytes",
        "brotli": "unsupported content coding",
        "many": "more than 1000 samples",
    }
    add_targets(
        db_engine,
        *({"url": f"{hostile}/{name}", "instance": name, "sample_limit": 100} for name in errors),
    )
    registry = CollectorRegistry()
    scraper = Scraper(db_engine, policy=LOOPBACK, timeout_s=5.0, clock=lambda: NOW, metrics=ScrapeMetrics(registry))
    started = time.monotonic()
    try:
        outcomes = {o.url.rsplit("/", 1)[-1]: o for o in scraper.run_once()}
    finally:
        scraper.stop()
    assert time.monotonic() - started < 5.0
    assert {name: o.error for name, o in outcomes.items()} == errors
    assert outcomes["gzip"].up and outcomes["gzip"].points == 1
    for name, error in errors.items():
        row = target_row(db_engine, name)
        assert row.up is (error is None) and row.last_error == error
        assert stored(db_engine, instance=name, name="up")[0][3] == (1.0 if error is None else 0.0)
    counted = {
        b: registry.get_sample_value("kvpilot_collector_scrape_bound_failures_total", {"bound": b}) for b in BOUNDS
    }
    assert counted == {"size": 1.0, "coding": 2.0, "samples": 1.0, "deadline": 0.0}


def test_inflation_stops_one_step_past_the_cap() -> None:
    body = BoundedBody(["gzip"], time.monotonic() + 60, 60.0)
    wire = bomb(64 << 20)  # 64 MiB inflated, about 64 KB on the wire, fed as one network chunk
    with pytest.raises(ScrapeError, match="larger than"):
        body.feed(wire)
    assert body.size <= MAX_SCRAPE_BYTES + INFLATE_STEP


def test_the_deadline_covers_inflation() -> None:
    body = BoundedBody(["gzip"], time.monotonic() - 1, 2.0)
    with pytest.raises(ScrapeError, match="deadline of 2s exceeded"):
        body.feed(bomb(8 << 20))
    assert body.size == 0


def test_a_truncated_or_invalid_body_fails() -> None:
    cut = BoundedBody(["gzip"], time.monotonic() + 60, 60.0)
    cut.feed(gzip.compress(PAGE)[:-8])
    with pytest.raises(ScrapeError, match="truncated"):
        cut.text()
    with pytest.raises(ScrapeError, match="invalid compressed body"):
        BoundedBody(["deflate"], time.monotonic() + 60, 60.0).feed(b"not deflate")
    assert BoundedBody(["identity"], time.monotonic() + 60, 60.0).inflater is None
