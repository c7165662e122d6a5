"""A real collector process, killed with SIGKILL mid-stream; an engine pushing while it is down.

Only loopback traffic; every loop is bounded by a deadline.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from collector.db import make_engine
from collector.server import CollectorProcess, start_subprocess
from collector.settings import CollectorSettings
from engine.http_sink import HttpSink
from plumbing.process import free_port
from tests.collector import evfactory as ev

TOKEN = "reliable"


def _settings(url: str, port: int) -> CollectorSettings:
    return CollectorSettings(
        db_url=url,
        ingest_token=TOKEN,
        port=port,
        scrape_enabled=False,
        log_level="warning",
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )


def _send_until_acked(client: httpx.Client, url: str, key: str, body: bytes, deadline: float) -> int:
    """The sender's retry loop: same key every time, until a 2xx (or the deadline)."""
    while time.monotonic() < deadline:
        try:
            resp = client.post(
                f"{url}/v1/ingest",
                content=body,
                headers={
                    "Authorization": f"Bearer {TOKEN}",
                    "Idempotency-Key": key,
                    "Content-Type": "application/json",
                },
            )
        except httpx.HTTPError:
            time.sleep(0.02)
            continue
        if resp.status_code in (200, 202):
            return resp.status_code
        assert resp.status_code >= 500, resp.text
        time.sleep(0.02)
    raise AssertionError(f"batch {key} never acknowledged")


def test_kill_9_loses_no_acknowledged_batch_and_stores_none_twice(sqlite_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "collector.log"
    proc: CollectorProcess = start_subprocess(_settings(sqlite_url, port), log_path=log)
    n_batches, per_batch, senders = 48, 200, 3
    batches = {
        f"batch-{b}": ev.body(ev.mixed(per_batch, start=b * per_batch, run_id=f"b{b}")) for b in range(n_batches)
    }
    acked: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + 90

    def sender(keys: list[str]) -> None:
        with httpx.Client(timeout=5.0) as client:
            for key in keys:
                status = _send_until_acked(client, proc_url, key, batches[key], deadline)
                with lock:
                    acked[key] = status

    proc_url = proc.url
    keys = list(batches)
    threads = [threading.Thread(target=sender, args=(keys[i::senders],)) for i in range(senders)]
    for t in threads:
        t.start()
    kills = 0
    for threshold in (n_batches // 4, n_batches // 2):
        while len(acked) < threshold and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.kill()  # SIGKILL while the senders keep posting
        kills += 1
        proc = start_subprocess(_settings(sqlite_url, port), log_path=log)
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    proc.stop()
    assert kills == 2 and len(acked) == n_batches

    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        stored_keys = set(conn.execute(text("SELECT idempotency_key FROM ingest_batches")).scalars())
        total, distinct = conn.execute(text("SELECT count(*), count(DISTINCT request_id) FROM requests")).one()
        per_run = dict(conn.execute(text("SELECT run_id, count(*) FROM steps GROUP BY run_id")).all())
    engine.dispose()
    assert stored_keys == set(batches)
    assert total == distinct == n_batches * per_batch // 4
    assert set(per_run.values()) == {per_batch // 4}


def test_bad_requests_over_real_http_store_nothing(sqlite_url: str) -> None:
    proc = start_subprocess(_settings(sqlite_url, 0))
    try:
        with httpx.Client(timeout=5.0) as client:
            url = f"{proc.url}/v1/ingest"
            assert client.post(url, content=ev.body(ev.mixed(4))).status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert (
                client.post(url, content=ev.body(ev.mixed(4)), headers={"Authorization": "Bearer x"}).status_code == 403
            )
            bad = ev.mixed(4)
            bad[3]["v"] = 7
            resp = client.post(url, content=ev.body(bad), headers=auth)
            assert resp.status_code == 422 and resp.json()["errors"][0]["loc"] == "events[3].v"
            assert (
                client.post(url, content=b"\x1f\x8b\x08junk", headers={**auth, "Content-Encoding": "gzip"}).status_code
                == 400
            )
            huge = json.dumps({"events": [ev.sample(i) for i in range(100)] * 1000}).encode()
            assert client.post(url, content=huge, headers=auth).status_code == 413
    finally:
        proc.stop()
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ingest_batches")).scalar_one() == 0
    engine.dispose()


def test_engine_keeps_serving_while_collector_is_down_then_everything_arrives(sqlite_url: str, tmp_path: Path) -> None:
    llm_engine = pytest.importorskip("engine.llm_engine")
    from engine.config import EngineConfig
    from engine.sequence import SamplingParams

    port = free_port()
    sink = HttpSink(
        f"http://127.0.0.1:{port}",
        token=TOKEN,
        batch_size=64,
        flush_interval_s=0.05,
        spool_dir=tmp_path / "spool",
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    cfg = EngineConfig.from_dict({"device": "cpu", "telemetry": {"instance": "eng-down", "run_id": "down"}})
    engine = llm_engine.LLMEngine(cfg, sink=sink)
    started = time.monotonic()
    seqs = engine.generate([[5 + i, 6, 7, 8, 9] * 4 for i in range(12)], SamplingParams(max_tokens=8, ignore_eos=True))
    served_s = time.monotonic() - started
    assert [s.num_output_tokens for s in seqs] == [8] * 12
    engine.events.maybe_sample(queue_depth=0, running=0, force=True)
    sink.flush()
    assert served_s < 30
    assert sink.sent == 0 and sink.spooled > 0 and sink.dropped == 0
    emitted = sink.spooled

    proc = start_subprocess(_settings(sqlite_url, port))
    try:
        assert sink.wait_drained(30), "spool did not drain"
    finally:
        sink.close()
        proc.stop()
    assert sink.sent == emitted and sink.dropped == 0
    db = make_engine(sqlite_url)
    with db.connect() as conn:
        requests = conn.execute(text("SELECT count(*) FROM requests WHERE run_id = 'down'")).scalar_one()
        steps = conn.execute(text("SELECT count(*) FROM steps WHERE run_id = 'down'")).scalar_one()
        total = sum(
            conn.execute(text(f"SELECT count(*) FROM {t} WHERE instance = 'eng-down'")).scalar_one()
            for t in ("requests", "steps", "alloc_events", "samples")
        )
        ordered = conn.execute(
            text("SELECT count(*) FROM steps a JOIN steps b ON b.id = a.id + 1 WHERE b.step < a.step")
        ).scalar_one()
    db.dispose()
    assert requests == 12 and steps > 0
    assert total == emitted
    assert ordered == 0, "steps arrived out of order"
