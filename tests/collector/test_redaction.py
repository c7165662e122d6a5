"""Credentials in a target URL reach the scraped endpoint and nothing else: not the API's answers, not the
dashboard's read, not a log line (ours or httpx's request line)."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest
from fastapi.testclient import TestClient

from collector.queries import target_health
from collector.redact import redact_text, redact_url
from collector.server import create_app
from collector.settings import CollectorSettings
from plumbing.process import free_port

ADMIN = {"Authorization": "Bearer adm1n"}
SECRETS = ("hunter2", "tok-123", "sig-456")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:hunter2@h:9/metrics?token=tok-123&x=1", "http://***@h:9/metrics?token=***&x=1"),
        (
            "https://h/m?api_key=a&X-Amz-Signature=b&Password=c&q",
            "https://h/m?api_key=***&X-Amz-Signature=***&Password=***&q",
        ),
        ("https://h/m#access_token=zz", "https://h/m#access_token=***"),
        ("http://[::1]:8000/metrics?page=2", "http://[::1]:8000/metrics?page=2"),  # nothing secret: unchanged
        ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000/metrics"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_finds_every_url() -> None:
    line = 'HTTP Request: GET http://u:hunter2@10.0.0.5:9/m?token=tok-123 "HTTP/1.1 200 OK" (from http://a:b@c/)'
    assert (
        redact_text(line)
        == 'HTTP Request: GET http://***@10.0.0.5:9/m?token=*** "HTTP/1.1 200 OK" (from http://***@c/)'
    )


class _Exporter(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        data = b"# TYPE up gauge\nkvpilot_dummy 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def exporter() -> Iterator[int]:
    _Exporter.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_target_credentials_reach_only_the_scrape(
    sqlite_url: str, exporter: int, caplog: pytest.LogCaptureFixture
) -> None:
    settings = CollectorSettings(
        db_url=sqlite_url,
        ingest_token="s3cret",
        admin_token="adm1n",
        scrape_allow_nets="127.0.0.0/8",
        scrape_default_interval_s=1.0,
    )
    url = f"http://scraper:hunter2@127.0.0.1:{exporter}/metrics?token=tok-123&sig=sig-456"
    dead = f"http://scraper:hunter2@127.0.0.1:{free_port()}/metrics?token=tok-123"
    caplog.set_level(logging.INFO)
    with TestClient(create_app(settings)) as c:
        created = c.post("/v1/targets", json={"url": url, "instance": "gpu-0"}, headers=ADMIN)
        assert created.status_code == 201, created.text
        assert c.post("/v1/targets", json={"url": dead, "instance": "gpu-1"}, headers=ADMIN).status_code == 201
        again = c.post("/v1/targets", json={"url": url, "instance": "gpu-9"}, headers=ADMIN)
        assert again.status_code == 409
        deadline = time.monotonic() + 20
        listed: list[dict] = []
        while time.monotonic() < deadline:
            listed = c.get("/v1/targets", headers={"Authorization": "Bearer s3cret"}).json()
            if all(t["last_scrape_at"] is not None for t in listed):
                break
            time.sleep(0.1)
        one = c.get(f"/v1/targets/{created.json()['id']}", headers=ADMIN).json()
        shown = [created.text, again.text, str(listed), str(one)]
        read = target_health(c.app.state.kvpilot.engine)  # the dashboard's read
    assert [t["up"] for t in listed] == [True, False]
    assert listed[0]["url"] == f"http://***@127.0.0.1:{exporter}/metrics?token=***&sig=***"
    assert read[0].url == listed[0]["url"]
    # The scrape itself still carried them: basic auth from the userinfo, the query as given.
    assert ("/metrics?token=tok-123&sig=sig-456", "Basic c2NyYXBlcjpodW50ZXIy") in _Exporter.seen
    logged = [r.getMessage() for r in caplog.records]
    assert any("HTTP Request: GET" in m for m in logged)  # httpx's line is there, redacted
    assert any("scrape of http://***@127.0.0.1" in m and "failed" in m for m in logged)
    for text in [*shown, str(read), *logged]:
        for secret in SECRETS:
            assert secret not in text, text
