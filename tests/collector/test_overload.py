"""Admission control against a real collector serving in a thread: the storage stage is held shut (a
patched `store_pushes` waits on an event) while concurrent pushes arrive. Loopback only; every wait is
bounded."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from collector import ingest
from collector.db import make_engine
from collector.schema import IngestBatch
from collector.server import ingest_routes as ingest_routes_module
from collector.server import run_in_thread
from collector.settings import CollectorSettings
from plumbing.serving import ThreadServer
from tests.collector import evfactory as ev

TOKEN = "s3cret"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@dataclass
class Shut:
    """Holds the storage stage shut until `open()`; counts the batches that reached it."""

    entered: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)
    calls: int = 0

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def store(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            assert self.opened.wait(30), "storage stage never opened"
            return real(*args, **kwargs)

        return store

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def shut(monkeypatch: pytest.MonkeyPatch) -> Iterator[Shut]:
    gate = Shut()
    monkeypatch.setattr(ingest_routes_module, "store_pushes", gate.wrap(ingest.store_pushes))
    yield gate
    gate.open()


@pytest.fixture
def serve(sqlite_url: str) -> Iterator[Callable[..., ThreadServer]]:
    handles: list[ThreadServer] = []

    def start(**overrides: Any) -> ThreadServer:
        settings = CollectorSettings(
            db_url=sqlite_url,
            ingest_token=TOKEN,
            port=0,
            scrape_enabled=False,
            log_level="warning",
            raw_retention_days=ev.REPLAY_RETENTION_DAYS,
            **overrides,
        )
        handles.append(run_in_thread(settings))
        return handles[-1]

    yield start
    for handle in handles:
        handle.stop()


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def batches(sqlite_url: str) -> int:
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(IngestBatch.__table__)).scalar_one()
    engine.dispose()
    return n


async def _post(client: httpx.AsyncClient, path: str, body: bytes, key: str, **headers: str) -> httpx.Response:
    return await client.post(path, content=body, headers={**HEADERS, "Idempotency-Key": key, **headers})


def test_past_the_in_flight_bound_pushes_get_429_and_health_stays_fast(serve, shut: Shut, sqlite_url: str) -> None:
    """48 pushes while the database takes none: 4 are admitted, 44 answered 429 at once, /health fast."""
    handle = serve(max_inflight_requests=4, storage_wait_s=30, retry_after_s=2)

    async def scenario() -> tuple[list[httpx.Response], int, list[float]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=handle.url, timeout=20, limits=limits) as client:
            pushes = [
                asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4, start=i)), f"k{i}"))
                for i in range(48)
            ]
            await asyncio.to_thread(shut.entered.wait, 10)
            await asyncio.sleep(0.5)
            health = []
            async with httpx.AsyncClient(base_url=handle.url, timeout=2.0) as probe:
                for _ in range(5):
                    started = time.perf_counter()
                    assert (await probe.get("/health")).status_code == 200
                    health.append(time.perf_counter() - started)
            answered_while_shut = sum(p.done() for p in pushes)
            shut.open()
            return list(await asyncio.gather(*pushes)), answered_while_shut, health

    responses, answered_while_shut, health = asyncio.run(scenario())
    assert answered_while_shut == 44
    assert sorted(r.status_code for r in responses) == [202] * 4 + [429] * 44
    # Retry-After: 2 s, times how many in-flight bounds' worth were refused in the last second (spreads them).
    retry = sorted(int(r.headers["retry-after"]) for r in responses if r.status_code == 429)
    # (44 refusals at once: 22 by the end, even if a second's boundary splits them.)
    assert retry[0] == 2 and 2 * (22 // 4) <= retry[-1] <= 2 * (44 // 4) and all(v % 2 == 0 for v in retry)
    assert max(health) < 0.5, health
    assert metric(handle.url, "kvpilot_collector_ingest_rejected_total", reason="overloaded") == 44
    assert metric(handle.url, "kvpilot_collector_inflight_requests") == 0
    assert batches(sqlite_url) == 4


def test_a_push_that_waits_too_long_for_the_database_gets_503(serve, shut: Shut) -> None:
    handle = serve(max_inflight_requests=4, storage_wait_s=0.5)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=handle.url, timeout=10) as client:
            first = asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4)), "a"))
            await asyncio.to_thread(shut.entered.wait, 10)
            started = time.perf_counter()
            second = await _post(client, "/v1/ingest", ev.body(ev.mixed(4, start=4)), "b")
            assert 0.4 < time.perf_counter() - started < 3
            shut.open()
            assert (await first).status_code == 202
            return second

    second = asyncio.run(scenario())
    assert second.status_code == 503 and second.headers["retry-after"] == "1", second.text
    assert metric(handle.url, "kvpilot_collector_ingest_rejected_total", reason="storage_busy") == 1


def test_a_push_behind_a_backlog_the_database_cannot_clear_in_time_is_refused_at_once(
    serve, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds of one push (`ingest_group_max_batches` 1) that take ~0.4 s, a push may wait 1 s: with a round in
    the database and three pushes queued behind it (~1.2 s of work), the next push is answered 503
    `storage_backlog` at once, with Retry-After and without being stored; the queued ones are stored."""
    turns = threading.Semaphore(0)
    entered = threading.Event()
    real = ingest.store_pushes

    def store(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert turns.acquire(timeout=30), "the storage stage was never given its turn"
        return real(*args, **kwargs)

    monkeypatch.setattr(ingest_routes_module, "store_pushes", store)
    handle = serve(ingest_group_max_batches=1, storage_wait_s=1.0)

    async def scenario() -> tuple[httpx.Response, float, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=handle.url, timeout=20) as client:
            first = asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4)), "a"))
            await asyncio.to_thread(entered.wait, 10)
            await asyncio.sleep(0.4)
            turns.release()  # the first round, timed: one push in ~0.4 s
            assert (await first).status_code == 202
            entered.clear()
            queued = [
                asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4, start=4 * i)), f"q{i}"))
                for i in range(1, 5)
            ]
            await asyncio.to_thread(entered.wait, 10)  # one of them in the database, three queued behind it
            deadline = time.monotonic() + 5
            while metric(handle.url, "kvpilot_collector_inflight_requests") < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # parsed, at the storage stage
            started = time.perf_counter()
            refused = await _post(client, "/v1/ingest", ev.body(ev.mixed(4, start=40)), "late")
            took = time.perf_counter() - started
            for _ in range(4):
                turns.release()
            return refused, took, list(await asyncio.gather(*queued))

    refused, took, stored = asyncio.run(scenario())
    assert refused.status_code == 503, refused.text
    assert "the database needs" in refused.json()["detail"] and refused.headers["retry-after"] == "1"
    assert took < 0.5  # at once, not after its wait
    assert [r.status_code for r in stored] == [202] * 4
    assert metric(handle.url, "kvpilot_collector_ingest_rejected_total", reason="storage_backlog") == 1
    assert batches(sqlite_url) == 5


def test_a_push_whose_client_left_is_not_processed(serve, shut: Shut, sqlite_url: str) -> None:
    handle = serve(storage_wait_s=30)
    first = threading.Thread(
        target=lambda: httpx.post(f"{handle.url}/v1/ingest", content=ev.body(ev.mixed(4)), headers=HEADERS, timeout=20),
    )
    first.start()
    assert shut.entered.wait(10)
    body = ev.body(ev.mixed(4, start=4))
    head = f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.3)  # the body is read and the push is queued for the storage stage
    deadline = time.monotonic() + 5
    while metric(handle.url, "kvpilot_collector_ingest_rejected_total", reason="client_disconnected") < 1:
        assert time.monotonic() < deadline, "the departed client's push is still queued"
        time.sleep(0.1)
    shut.open()
    first.join(10)
    assert shut.calls == 1 and batches(sqlite_url) == 1


def test_inflated_bytes_in_flight_are_bounded(serve, shut: Shut, monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded gzip: 1.5 MiB inflated from a few KiB. With a 4.5 MiB budget the second one cannot inflate
    while the first is held (and joining one's parts needs 3 MiB for a moment); inflation runs on the
    inflater threads, not on the event loop."""
    from collector.server import admission

    threads: list[str] = []
    real_inflate = admission.inflate

    def spy(*args: Any, **kwargs: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return real_inflate(*args, **kwargs)

    monkeypatch.setattr(admission, "inflate", spy)
    handle = serve(max_batch_bytes=64 * 1024, max_decompressed_bytes=2 * 2**20, max_inflight_bytes=9 * 2**19)
    padded = [gzip.compress(ev.body(ev.mixed(4, start=i))[:-2] + b" " * (3 * 2**19) + b"]}") for i in (0, 4)]
    assert all(len(p) < 16 * 1024 for p in padded)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=handle.url, timeout=20) as client:
            first = asyncio.create_task(_post(client, "/v1/ingest", padded[0], "p0", **{"Content-Encoding": "gzip"}))
            await asyncio.to_thread(shut.entered.wait, 10)
            second = await _post(client, "/v1/ingest", padded[1], "p1", **{"Content-Encoding": "gzip"})
            shut.open()
            return await first, second

    first, second = asyncio.run(scenario())
    assert first.status_code == 202, first.text
    assert second.status_code == 429 and second.headers["retry-after"] == "1", second.text
    assert metric(handle.url, "kvpilot_collector_ingest_rejected_total", reason="overloaded_bytes") == 1
    assert metric(handle.url, "kvpilot_collector_inflight_bytes") == 0
    assert threads and all(name.startswith("kvpilot-inflate") for name in threads)


def test_otlp_pushes_share_the_admission_bound(serve, shut: Shut) -> None:
    handle = serve(max_inflight_requests=1)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=handle.url, timeout=10) as client:
            first = asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4)), "a"))
            await asyncio.to_thread(shut.entered.wait, 10)
            traces = await client.post("/v1/traces", content=b"{}", headers=HEADERS)
            shut.open()
            assert (await first).status_code == 202
            return traces

    traces = asyncio.run(scenario())
    assert traces.status_code == 429 and traces.headers["retry-after"] == "1"
    assert traces.headers["content-type"] == "application/json" and "in flight" in traces.json()["message"]


def test_health_reports_the_probe_which_runs_off_the_request_path(sqlite_url: str) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    from collector.server import create_app
    from collector.server.health_routes import HealthProbe

    now = [0.0]
    engine = make_engine(sqlite_url)
    try:
        probe = HealthProbe(engine, interval_s=5.0, clock=lambda: now[0])
        assert probe.status() is None
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'deadbeef0000'"))
        probe.check_once()
        assert probe.status() == ("schema_outdated", f"database at revision deadbeef0000, not head {probe.head}")
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": probe.head})
        probe.check_once()
        assert probe.status() is None
        now[0] = 16.0  # no check completed for over 3 intervals (at least 15 s)
        assert probe.status() == ("health_check_overdue", "the database check has not completed for 16s")
    finally:
        engine.dispose()
    settings = CollectorSettings(db_url=sqlite_url, scrape_enabled=False)
    with TestClient(create_app(settings)) as client:
        assert client.get("/health").json() == {"status": "ok"}
        client.app.state.kvpilot.health._failure = ("database_unavailable", "database unreachable")
        answer = client.get("/health")
        assert answer.status_code == 503 and answer.json() == {"detail": "database unreachable"}


def test_refusals_are_logged_once_per_reason_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    from collector.server.errors import RefusalLog

    now = [100.0]
    refusals = RefusalLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="kvpilot.collector"):
        for _ in range(5):
            refusals("overloaded", "POST /v1/ingest -> 429 overloaded")
        refusals("unauthorized", "POST /v1/ingest -> 401 unauthorized")
        now[0] = 111.0
        refusals("overloaded", "POST /v1/ingest -> 429 overloaded")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("WARNING", "POST /v1/ingest -> 429 overloaded"),
        ("INFO", "POST /v1/ingest -> 401 unauthorized"),
        ("WARNING", "POST /v1/ingest -> 429 overloaded (and 4 more 'overloaded' refusals since the last line)"),
    ]


def test_a_trickling_body_does_not_hold_a_slot(serve) -> None:
    handle = serve(max_inflight_requests=1, body_timeout_s=0.5)
    body = ev.body(ev.mixed(4))
    head = f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", handle.port), timeout=5) as sock:
        sock.sendall(head.encode() + body[:10])  # and nothing more
        started = time.monotonic()
        answer = sock.recv(4096).decode()
        assert time.monotonic() - started < 3
    assert answer.startswith("HTTP/1.1 408"), answer
    ok = httpx.post(f"{handle.url}/v1/ingest", content=body, headers=HEADERS, timeout=10)
    assert ok.status_code == 202, ok.text


def test_pushes_queued_behind_a_round_are_stored_as_one_group(serve, shut: Shut, sqlite_url: str) -> None:
    """While the database holds one push, three more queue; the next round stores the three in one transaction
    (group commit), each acknowledged with its own batch."""
    handle = serve(max_inflight_requests=8, storage_wait_s=30)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=handle.url, timeout=20) as client:
            first = asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4)), "k0"))
            await asyncio.to_thread(shut.entered.wait, 10)
            rest = [
                asyncio.create_task(_post(client, "/v1/ingest", ev.body(ev.mixed(4, start=4 * i)), f"k{i}"))
                for i in (1, 2, 3)
            ]
            await asyncio.sleep(0.5)  # all three read and queued
            shut.open()
            return [await first, *(await asyncio.gather(*rest))]

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [202] * 4
    assert len({r.json()["batch_id"] for r in responses}) == 4 and batches(sqlite_url) == 4
    assert shut.calls == 2  # two storage rounds: the first push alone, then the three together
    assert metric(handle.url, "kvpilot_collector_ingest_group_batches_count") == 2
    assert metric(handle.url, "kvpilot_collector_ingest_group_batches_sum") == 4
