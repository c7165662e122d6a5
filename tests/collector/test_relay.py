"""Bundles and the node relay: several engines' pushes in one request, each stored and answered as if alone.

The bundle endpoint on a real collector (SQLite and PostgreSQL), the relay between real engines' sinks and
that collector, and the relay's answers when the collector is down. Nothing here is a mock of the collector."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from collector import bundle
from collector.db import make_engine
from collector.relay import RelayConfig, create_app
from collector.schema import IngestBatch, StepRow
from collector.server import run_in_thread
from collector.server.admission import StorageGate
from collector.settings import CollectorSettings
from engine.events import SampleEvent
from engine.http_sink import HttpSink
from plumbing.serving import ThreadServer, serve_in_thread
from tests.collector import evfactory as ev

TOKEN = "relay-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def collector(db_url: str) -> Iterator[ThreadServer]:
    settings = CollectorSettings(
        db_url=db_url,
        ingest_token=TOKEN,
        scrape_enabled=False,
        max_batch_events=500,
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
        log_level="warning",
    )
    with run_in_thread(settings) as server:
        yield server


def _count(db_url: str, model: Any) -> int:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()
    finally:
        engine.dispose()


def _steps(instance: str, n: int, start: int = 0) -> bytes:
    return ev.body([ev.step(i, instance=instance) for i in range(start, start + n)])


def test_a_bundle_stores_each_member_as_it_would_have_been_stored_alone(collector: ThreadServer, db_url: str) -> None:
    with httpx.Client(base_url=collector.url, headers=AUTH, timeout=30.0) as client:
        before = client.post("/v1/ingest", content=_steps("node-a", 2), headers={"Idempotency-Key": "pushed-before"})
        assert before.status_code == 202
        members = [
            bundle.Member("a-1", _steps("node-a", 3, start=10)),
            bundle.Member("pushed-before", _steps("node-a", 2)),  # a retry of a stored push
            bundle.Member("bad-1", ev.body([ev.step(0, instance="node-b", num_seqs=-1)])),
            bundle.Member(None, _steps("node-b", 4, start=20)),
            bundle.Member("a-1", _steps("node-a", 3, start=10)),  # the same key twice in one bundle
        ]
        body = gzip.compress(bundle.encode(members))
        headers = {"Content-Type": bundle.MEDIA_TYPE, "Content-Encoding": "gzip"}
        resp = client.post(bundle.PATH, content=body, headers=headers)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert [r["status"] for r in results] == [202, 200, 422, 202, 200]
    assert results[0]["events"] == 3 and results[0]["idempotency_key"] == "a-1" and not results[0]["duplicate"]
    assert results[1]["duplicate"] and results[1]["batch_id"] == before.json()["batch_id"]
    assert results[2]["key"] == "bad-1" and "num_seqs" in results[2]["detail"] and results[2]["errors"]
    assert results[3]["idempotency_key"].startswith("server-") and results[3]["events"] == 4
    assert results[4]["duplicate"] and results[4]["batch_id"] == results[0]["batch_id"]
    assert _count(db_url, StepRow) == 2 + 3 + 4
    assert _count(db_url, IngestBatch) == 3  # the push before, and a-1 and the key-less member: a record each


@pytest.mark.parametrize(
    ("after_a_good_member", "said"),
    [
        (b'{"key": "k", "length": 99}\n{}', "member 1: 99 bytes announced, 2 left"),
        (b'{"key": "k"}\n', "member 1: the header must be an object of exactly 'key' and 'length'"),
        (b"no header line", "member 1: no header line"),
        (b'{"key": "a b", "length": 0}\n', "member 1: key must be null or 1-200 printable ASCII"),
        (None, "no members"),
    ],
)
def test_a_malformed_bundle_stores_nothing_and_says_why(
    collector: ThreadServer, db_url: str, after_a_good_member: bytes | None, said: str
) -> None:
    good = bundle.encode([bundle.Member("good", _steps("node-a", 1))])
    content = b"" if after_a_good_member is None else good + after_a_good_member
    with httpx.Client(base_url=collector.url, headers=AUTH, timeout=30.0) as client:
        resp = client.post(bundle.PATH, content=content, headers={"Content-Type": bundle.MEDIA_TYPE})
        assert resp.status_code == 400 and said in resp.json()["detail"]
        wrong_media = client.post(bundle.PATH, content=good, headers={"Content-Type": "application/json"})
        assert wrong_media.status_code == 415
        unauthenticated = httpx.post(collector.url + bundle.PATH, content=good)
        assert unauthenticated.status_code == 401
    assert _count(db_url, StepRow) == 0


def test_too_many_members_are_refused_whole() -> None:
    data = bundle.encode([bundle.Member(f"k{i}", b"{}") for i in range(5)])
    assert len(bundle.decode(data, max_members=5)) == 5
    with pytest.raises(bundle.BundleError, match="more than 4 members"):
        bundle.decode(data, max_members=4)


def test_a_bundle_counts_its_members_against_the_group_bound() -> None:
    """A bundle of 3 behind a lone push fills a group of 4; the next bundle waits for the next round."""

    async def scenario() -> list[list[Any]]:
        gate = StorageGate(max_group=4)
        rounds: list[list[Any]] = []
        release = asyncio.Event()

        async def store(items: list[Any]) -> list[Any]:
            rounds.append(items)
            await release.wait()
            return items

        never_gone = asyncio.get_running_loop().create_future()  # the client never leaves

        def run(item: Any, count: int) -> asyncio.Task[Any]:
            return asyncio.ensure_future(
                gate.run(item, store, group=True, size=1, count=count, timeout_s=5.0, gone=never_gone)
            )

        first = run("first", 1)
        await asyncio.sleep(0)
        tasks = [first, run("alone", 1), run("bundle-3", 3), run("bundle-2", 2)]
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(*tasks)
        return rounds

    assert asyncio.run(scenario()) == [["first"], ["alone", "bundle-3"], ["bundle-2"]]


# --- the relay ---------------------------------------------------------------------------------------


@pytest.fixture
def relay(collector: ThreadServer) -> Iterator[tuple[ThreadServer, CollectorRegistry]]:
    registry = CollectorRegistry()
    config = RelayConfig(collector.url, TOKEN, flush_interval_s=0.3)
    with serve_in_thread(create_app(config, registry), name="kvpilot-relay") as server:
        yield server, registry


def test_the_relay_forwards_concurrent_pushes_as_one_bundle_and_answers_each(
    relay: tuple[ThreadServer, CollectorRegistry], db_url: str
) -> None:
    server, registry = relay
    pushes = {f"engine-{i}-1": _steps(f"engine-{i}", 5, start=100 * i) for i in range(4)}
    pushes["engine-bad-1"] = ev.body([ev.step(0, instance="engine-bad", num_seqs=-1)])
    answers: dict[str, httpx.Response] = {}

    def push(key: str, body: bytes) -> None:
        headers = {**AUTH, "Idempotency-Key": key, "Content-Type": "application/json"}
        answers[key] = httpx.post(server.url + "/v1/ingest", content=body, headers=headers, timeout=30.0)

    threads = [threading.Thread(target=push, args=item) for item in pushes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        got = answers[f"engine-{i}-1"]
        assert got.status_code == 202 and got.json()["events"] == 5 and got.json()["idempotency_key"] == f"engine-{i}-1"
    assert answers["engine-bad-1"].status_code == 422 and "num_seqs" in answers["engine-bad-1"].json()["detail"]
    assert registry.get_sample_value("kvpilot_relay_bundles_total", {"outcome": "stored"}) == 1
    assert registry.get_sample_value("kvpilot_relay_bundle_members_sum") == 5
    retry = httpx.post(
        server.url + "/v1/ingest",
        content=gzip.compress(pushes["engine-0-1"]),
        headers={**AUTH, "Idempotency-Key": "engine-0-1", "Content-Encoding": "gzip"},
        timeout=30.0,
    )
    assert retry.status_code == 200 and retry.json()["duplicate"]
    assert _count(db_url, StepRow) == 20


def test_the_relay_refuses_what_the_collector_would(
    relay: tuple[ThreadServer, CollectorRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    server, registry = relay
    url = server.url + "/v1/ingest"
    assert httpx.post(url, content=b"{}").status_code == 401
    assert httpx.post(url, content=b"{}", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.post(url, content=b"{}", headers={**AUTH, "Content-Type": "text/plain"}).status_code == 415
    bad_key = httpx.post(url, content=b"{}", headers={**AUTH, "Idempotency-Key": "a b"})
    assert bad_key.status_code == 422 and "Idempotency-Key" in bad_key.json()["detail"]
    bomb = gzip.compress(b" " * (17 * 2**20))
    assert httpx.post(url, content=bomb, headers={**AUTH, "Content-Encoding": "gzip"}).status_code == 413
    assert registry.get_sample_value("kvpilot_relay_refused_total", {"reason": "forbidden"}) == 1
    assert "push refused with 403 forbidden: wrong bearer token for pushes" in caplog.text


def test_an_engine_sink_behind_the_relay_gets_its_events_stored(
    relay: tuple[ThreadServer, CollectorRegistry], db_url: str
) -> None:
    server, _ = relay
    sink = HttpSink(server.url, token=TOKEN, flush_interval_s=0.05)
    try:
        for i in range(30):
            sink.emit(SampleEvent(instance="engine-sink", run_id="r", ts=ev.T0 + i, utilization=0.5))
        sink.flush()
        assert sink.wait_drained(30.0)
    finally:
        sink.close()
    assert sink.dropped == 0 and sink.rejected == 0
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            from collector.schema import SampleRow

            n = conn.execute(select(func.count()).select_from(SampleRow.__table__)).scalar_one()
    finally:
        engine.dispose()
    assert n == 30


def test_with_the_collector_down_every_held_push_is_told_to_retry() -> None:
    registry = CollectorRegistry()
    config = RelayConfig("http://127.0.0.1:9", TOKEN, flush_interval_s=0.05, upstream_timeout_s=2.0)
    with serve_in_thread(create_app(config, registry), name="kvpilot-relay") as server:
        resp = httpx.post(
            server.url + "/v1/ingest", content=_steps("x", 1), headers={**AUTH, "Idempotency-Key": "x-1"}, timeout=30.0
        )
        metrics = httpx.get(server.url + "/metrics").text
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert "could not be reached" in resp.json()["detail"]
    assert 'kvpilot_relay_bundles_total{outcome="unreachable"} 1.0' in metrics
    assert json.loads(json.dumps(resp.json())) == resp.json()


def test_the_relay_command_refuses_what_it_cannot_serve_safely(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvpilot.cli_collector import collector_app

    runner = CliRunner()
    public_bind = ["relay", "--upstream", "http://10.0.0.5:8100", "--host", "0.0.0.0"]
    public = runner.invoke(collector_app, public_bind, env={"KVPILOT_INGEST_TOKEN": None})
    assert public.exit_code == 1 and "refusing to serve the relay on 0.0.0.0 without an ingest token" in public.output
    scheme = runner.invoke(collector_app, ["relay", "--upstream", "ftp://x", "--token-file", str(tmp_path / "none")])
    assert scheme.exit_code == 1 and "none" in scheme.output  # the missing token file, named
    (tmp_path / "token").write_text("t\n")
    bad = runner.invoke(collector_app, ["relay", "--upstream", "ftp://x", "--token-file", str(tmp_path / "token")])
    assert bad.exit_code == 1 and "upstream must be an http(s) URL" in bad.output
    assert "Traceback" not in public.output + scheme.output + bad.output
