"""engine.http_sink against a real collector in this process: losses reach the collector as gap records, a
wrong token stops the sink loudly, the drain starts soon after an outage, and Retry-After is obeyed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import text

from collector.db import make_engine
from collector.server import run_in_thread
from collector.settings import CollectorSettings
from engine.events import RequestEvent, SampleEvent
from engine.http_sink import HttpSink
from plumbing.process import free_port
from plumbing.serving import ThreadServer
from tests.collector import evfactory as ev

TOKEN = "right-token"
T0 = 1_760_000_000.0


def sample(i: int) -> SampleEvent:
    return SampleEvent(instance="e0", run_id="r", ts=T0 + i, queue_depth=i)


def request(i: int) -> RequestEvent:
    return RequestEvent(
        instance="e0",
        run_id="r",
        ts=T0 + i,
        request_id=f"q{i}",
        status="finished",
        prompt_tokens=10,
        output_tokens=5,
        queue_s=0.0,
        prefill_s=0.01,
        decode_s=0.1,
        e2e_s=0.11,
    )


def start_collector(db_url: str, port: int) -> ThreadServer:
    settings = CollectorSettings(
        db_url=db_url, ingest_token=TOKEN, port=port, scrape_enabled=False, raw_retention_days=ev.REPLAY_RETENTION_DAYS
    )
    return run_in_thread(settings.model_copy(update={"log_level": "warning"}))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def sinks() -> Iterator[list[HttpSink]]:
    made: list[HttpSink] = []
    yield made
    for s in made:
        s.close(timeout_s=0.5)


def rows(db_url: str, sql: str) -> list[tuple]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def test_outage_losses_arrive_as_gap_records(sqlite_url: str, port: int, tmp_path: Path, sinks) -> None:
    sink = HttpSink(
        f"http://127.0.0.1:{port}",
        token=TOKEN,
        batch_size=20,
        flush_interval_s=0.02,
        spool_dir=tmp_path / "spool",
        spool_max_bytes=20_000,  # three batches of ~6 kB: the outage outlasts it
        compress=False,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        probe_interval_s=0.1,
    )
    sinks.append(sink)
    for i in range(400):
        sink.emit(request(i) if i % 4 == 0 else sample(i))
        if i % 20 == 19:
            sink.flush()
    sink.flush()
    lost = sink.dropped_by_reason()["spool_full"]
    assert lost > 0 and sink.sent == 0
    with start_collector(sqlite_url, port):
        assert sink.wait_drained(10)
    gaps = rows(sqlite_url, "SELECT kind, reason, events, first_ts, last_ts, instance, run_id FROM gaps ORDER BY kind")
    stored = (
        rows(sqlite_url, "SELECT count(*) FROM samples")[0][0] + rows(sqlite_url, "SELECT count(*) FROM requests")[0][0]
    )
    assert [(k, r) for k, r, *_ in gaps] == [("request", "spool_full"), ("sample", "spool_full")]  # one each
    assert sum(g[2] for g in gaps) == lost and stored + lost == 400
    for _kind, _reason, _n, first_ts, last_ts, instance, run_id in gaps:
        assert T0 <= first_ts <= last_ts < T0 + 400 and (instance, run_id) == ("e0", "r")
    assert sink.gaps_sent == 2


def test_gap_records_are_kept_while_the_collector_stays_down(port: int, tmp_path: Path, sqlite_url: str) -> None:
    """Bounded: one open entry per (kind, reason), counts adding up; saved at close, sent by the next sink."""
    opts = {"batch_size": 10, "flush_interval_s": 0.02, "spool_max_bytes": 10_000, "compress": False}
    sink = HttpSink(f"http://127.0.0.1:{port}", token=TOKEN, spool_dir=tmp_path, **opts)
    for i in range(200):
        sink.emit(sample(i))
        if i % 10 == 9:
            sink.flush()
    sink.close()
    lost = sink.dropped_by_reason()["spool_full"]
    assert lost > 0 and (tmp_path / "gaps.json").exists()
    with start_collector(sqlite_url, port):
        again = HttpSink(f"http://127.0.0.1:{port}", token=TOKEN, spool_dir=tmp_path, **opts)
        assert again.wait_drained(10)
        again.close()
    assert rows(sqlite_url, "SELECT kind, reason, events FROM gaps") == [("sample", "spool_full", lost)]
    assert not (tmp_path / "gaps.json").exists()


def test_wrong_token_stops_loudly_and_keeps_the_spool(
    sqlite_url: str, port: int, sinks, caplog: pytest.LogCaptureFixture
) -> None:
    registry = CollectorRegistry()
    with start_collector(sqlite_url, port) as collector:
        sink = HttpSink(
            collector.url,
            token="wrong",
            batch_size=10,
            flush_interval_s=0.02,
            spool_max_bytes=10_000,  # three batches of ~3 kB
            compress=False,
            backoff_initial_s=0.02,
            backoff_max_s=0.05,
            auth_max_tries=3,
            registry=registry,
        )
        sinks.append(sink)
        with caplog.at_level(logging.ERROR, logger="engine.http_sink"):
            for i in range(100):
                sink.emit(sample(i))
                if i % 10 == 9:
                    sink.flush()
                    time.sleep(0.03)
            time.sleep(0.3)
        assert sink.stopped and sink.auth_failures == 3  # bounded: no more tries once stopped
        by_reason = sink.dropped_by_reason()
        assert by_reason["unauthorized"] > 0 and by_reason["spool_full"] == 0
        assert len(sink.spool) == 3 and sink.sent == 0 and sink.dropped == by_reason["unauthorized"]
        metrics = generate_latest(registry).decode()
        assert (
            "kvpilot_telemetry_unauthorized 1.0" in metrics and "kvpilot_telemetry_auth_failures_total 3.0" in metrics
        )
        assert (
            f'kvpilot_telemetry_events_dropped_total{{reason="unauthorized"}} {by_reason["unauthorized"]}.0' in metrics
        )
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and collector.url in errors[0] and "HTTP 403" in errors[0]
    assert rows(sqlite_url, "SELECT count(*) FROM samples") == [(0,)]


def test_drain_starts_within_two_seconds_of_the_collectors_return(
    sqlite_url: str, port: int, tmp_path: Path, sinks
) -> None:
    # A long backoff (the first retry 2.5-7.5 s out): only the health probe can make the drain this quick.
    sink = HttpSink(
        f"http://127.0.0.1:{port}",
        token=TOKEN,
        batch_size=10,
        flush_interval_s=0.05,
        spool_dir=tmp_path,
        backoff_initial_s=5.0,
        backoff_max_s=10.0,
    )
    sinks.append(sink)
    for i in range(30):
        sink.emit(sample(i))
    sink.flush()
    assert len(sink.spool) > 0
    time.sleep(0.3)
    with start_collector(sqlite_url, port):
        back = time.monotonic()
        while sink.sent < 30 and time.monotonic() - back < 5:
            time.sleep(0.02)
        drained_after = time.monotonic() - back
    assert sink.sent == 30 and drained_after < 2.0, f"drained {drained_after:.1f}s after the collector returned"


def test_retry_after_is_honoured() -> None:
    attempts: list[float] = []
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            if request.url.path == "/health":
                return httpx.Response(200)
            attempts.append(time.monotonic())
            if len(attempts) == 1:
                return httpx.Response(429, headers={"Retry-After": "1"}, json={"detail": "busy"})
            return httpx.Response(202, json={})

    sink = HttpSink(
        "http://collector.test",
        client=httpx.Client(transport=httpx.MockTransport(handler)),
        batch_size=5,
        flush_interval_s=0.01,
        backoff_initial_s=0.01,
        probe_interval_s=0.01,
    )
    for i in range(5):
        sink.emit(sample(i))
    assert sink.wait_drained(5)
    sink.close()
    assert len(attempts) == 2 and 0.95 <= attempts[1] - attempts[0] < 1.5
    assert sink.sent == 5
