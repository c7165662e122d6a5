"""COPY (PostgreSQL's ingest writer) stores exactly what executemany stored, and keeps the batch guarantees."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, func, select, text

from collector import bulk, fastdecode
from collector.db import make_engine
from collector.errors import StorageError
from collector.ingest import EVENT_COLUMNS, parse_batch, store_batch
from collector.schema import EVENT_TABLES, IngestBatch, SeriesPoint
from tests.collector import evfactory as ev

pytestmark = pytest.mark.postgres

ODD = 'tab\there, newline\nhere, back\\slash, "quotes", caf\u00e9 \U0001f680'


def _events() -> list[dict]:
    """Every event type, with NULLs, extreme integers and floats, bools both ways and text COPY must escape."""
    return [
        ev.request(0, request_id=ODD, ttft_s=None, frontend_s=0.0, finish_reason=None, warmup=True),
        ev.request(1, ts=ev.T0 + 0.123456789, queue_s=0.1 + 0.2, decode_s=5e-324, finish_reason="stop"),
        ev.step(2, kv_blocks_total=2**62, step=2**40, preemptions=2**31 - 1),
        ev.alloc(3, request_id=None, op="swap_out", tier="cold", usage_after=1.0),
        ev.alloc(4, request_id=ODD),
        ev.sample(5, cold_usage=None, memory_total_bytes=2**63 - 1, source="dcgm", running=None),
        ev.sample(6, utilization=None, memory_used_bytes=None, memory_total_bytes=None, kv_usage=None),
        ev.gap(7, kind="step", reason="queue_full", events=2**40),
        ev.request(8, instance="e\u00e9", run_id="r\u00e9"),
    ]


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()


def _stored(engine: Engine, table, batch_id: int) -> list[tuple]:
    cols = [c for c in table.c if c.name not in ("id", "batch_id")]
    with engine.connect() as conn:
        rows = conn.execute(select(*cols).where(table.c.batch_id == batch_id).order_by(table.c.id)).all()
    return [tuple(row) for row in rows]


def _typed(rows: list[tuple]) -> list[tuple]:
    """Values with their Python types, so 1 and 1.0 or 0 and False do not compare equal."""
    return [tuple((type(v).__name__, v) for v in row) for row in rows]


@pytest.mark.parametrize("copy_format", ["binary", "text"])
@pytest.mark.parametrize("path", ["msgspec", "pydantic"])
def test_copy_stores_what_executemany_stored(pg_engine: Engine, copy_format: str, path: str) -> None:
    # ev.body escapes non-ASCII as \u, which sends the body to the pydantic validator; raw UTF-8 does not.
    body = ev.body(_events()) if path == "pydantic" else json.dumps({"events": _events()}, ensure_ascii=False).encode()
    assert (fastdecode.decode(body) is None) == (path == "pydantic")
    rows = parse_batch(body, max_events=100).rows
    assert set(rows) == set(EVENT_TABLES)
    with pg_engine.begin() as conn:
        for kind, kind_rows in rows.items():
            table, cols = EVENT_TABLES[kind], EVENT_COLUMNS[kind]
            conn.exec_driver_sql(bulk.executemany_sql("format", table.name, cols, ("batch_id",)).format(1), kind_rows)
            bulk.copy_rows(conn, table, cols, kind_rows, constants={"batch_id": 2}, copy_format=copy_format)
    for kind, table in EVENT_TABLES.items():
        by_executemany = _stored(pg_engine, table, 1)
        assert len(by_executemany) == len(rows[kind])
        assert _typed(_stored(pg_engine, table, 2)) == _typed(by_executemany), kind
    with pg_engine.connect() as conn:
        stored = conn.execute(select(EVENT_TABLES["request"].c.request_id, EVENT_TABLES["request"].c.ttft_s)).all()
    assert (ODD, None) in stored


@pytest.mark.parametrize("copy_format", ["binary", "text"])
def test_copied_series_points_keep_labels_json_and_null_target(pg_engine: Engine, copy_format: str) -> None:
    labels = json.dumps({"gpu": "0", "note": ODD}, separators=(",", ":"), sort_keys=True)
    points = [("node-1", "DCGM_FI_DEV_GPU_UTIL", labels, ev.T0 + 0.5, 97.25, None), ("n2", "up", "{}", ev.T0, 1.0, 7)]
    table = SeriesPoint.__table__
    cols = ("instance", "name", "labels", "ts", "value", "target_id")
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(bulk.executemany_sql("format", table.name, cols), points)
        bulk.copy_rows(conn, table, cols, points, constants={}, copy_format=copy_format)
    with pg_engine.connect() as conn:
        stored = conn.execute(select(*(table.c[c] for c in cols)).order_by(table.c.id)).all()
    assert _typed([tuple(r) for r in stored]) == _typed(points + points)
    assert json.loads(stored[-2].labels) == {"gpu": "0", "note": ODD}


def _store(engine: Engine, events: list[dict], key: str):
    body = ev.body(events)
    return store_batch(engine, parse_batch(body, max_events=100), idempotency_key=key, content=body)


def _counts(engine: Engine) -> dict[str, int]:
    tables = {**{kind: t for kind, t in EVENT_TABLES.items()}, "batches": IngestBatch.__table__}
    with engine.connect() as conn:
        return {name: conn.execute(select(func.count()).select_from(t)).scalar_one() for name, t in tables.items()}


def test_store_batch_copies_on_postgres_and_a_replay_stores_nothing_twice(
    pg_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied: list[str] = []
    real = bulk.copy_rows

    def spy(conn, table, *args, **kwargs):
        copied.append(table.name)
        return real(conn, table, *args, **kwargs)

    monkeypatch.setattr(bulk, "copy_rows", spy)
    first = _store(pg_engine, _events(), "replayed")
    assert sorted(copied) == sorted(t.name for t in EVENT_TABLES.values())
    before = _counts(pg_engine)
    again = _store(pg_engine, _events(), "replayed")
    assert again.duplicate and again.batch_id == first.batch_id
    assert _counts(pg_engine) == before and before["batches"] == 1 and before["request"] == 3


def test_a_copy_the_server_refuses_leaves_nothing_of_the_batch(
    pg_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dedup row and the rows copied before the failing table roll back with it; the error is translated."""
    real = bulk.copy_rows

    def poisoned(conn, table, columns, rows, **kwargs):
        if table.name == "steps":  # an instance wider than VARCHAR(200): refused by the server mid-COPY
            rows = [*rows, ("x" * 300, *rows[0][1:])]
        return real(conn, table, columns, rows, **kwargs)

    monkeypatch.setattr(bulk, "copy_rows", poisoned)
    with pytest.raises(StorageError, match="too long"):
        _store(pg_engine, _events(), "refused")
    assert set(_counts(pg_engine).values()) == {0}
    monkeypatch.setattr(bulk, "copy_rows", real)
    assert not _store(pg_engine, _events(), "refused").duplicate  # the key was not burnt
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM steps")).scalar_one() == 1
