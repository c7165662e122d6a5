"""The per-minute allocation rollup: ingest keeps it, maintenance computes what is older than it, and the KV
page's long windows (the operations chart, the trace's count) read it with the figures of every raw record."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from sqlalchemy import Engine, event, select

from collector import queries
from collector.bulk import insert_rows
from collector.ingest import EVENT_COLUMNS, parse_batch, store_batch
from collector.queries.step_rollup import ROLLUP_AFTER_S
from collector.retention import DAY, prune
from collector.rollup import ALLOCS_KIND, roll_up
from collector.schema import AllocRollup, AllocRow
from tests.collector import evfactory as ev

T0 = ev.T0
OPS = ("alloc", "free", "swap_out", "oom")


def records(n: int, *, seed: int, start: float = T0, span: float = 2400.0) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        ev.alloc(
            i,
            ts=start + span * i / n,
            instance=f"e{i % 3}",
            run_id=f"r{i % 2}",
            op=OPS[rnd.randrange(len(OPS))],
            tier="hot" if rnd.random() < 0.8 else "cold",
            blocks=rnd.randint(1, 64),
            bytes=rnd.randint(1, 64) * 4096,
        )
        for i in range(n)
    ]


def ingest(engine: Engine, events: list[dict[str, Any]], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=key, content=raw, now=T0 + 3000)


def expected(events: list[dict[str, Any]], start: float, end: float, bucket_s: float, **only: Any) -> list[tuple]:
    """(bucket, op, tier, events, blocks, bytes) of the records in the minutes the window touches, whole."""
    lo, hi = math.floor(start / 60.0) * 60.0, math.ceil(end / 60.0) * 60.0
    out: dict[tuple, list[int]] = {}
    for e in events:
        if not lo <= e["ts"] < hi or any(e[k] not in v for k, v in only.items()):
            continue
        key = (math.floor(e["ts"] / bucket_s) * bucket_s, e["op"], e["tier"])
        b = out.setdefault(key, [0, 0, 0])
        b[0] += 1
        b[1] += e["blocks"]
        b[2] += e["bytes"]
    return sorted((*k, *v) for k, v in out.items())


def got(buckets: list[queries.AllocOpBucket]) -> list[tuple]:
    return [(b.ts, b.op, b.tier, b.events, b.blocks, b.bytes) for b in buckets]


def test_ingest_keeps_the_rollup_and_long_windows_read_it(db_engine: Engine) -> None:
    events = records(3000, seed=1)
    for k in range(0, 3000, 700):  # minutes straddle the batches
        ingest(db_engine, events[k : k + 700], f"b{k}")
    ingest(db_engine, events[:700], "b0")  # a retry: a duplicate, added once
    start, end = T0 + 125.0, T0 + 2300.5  # neither on a minute
    assert end - start > ROLLUP_AFTER_S
    assert got(queries.alloc_ops_over_time(db_engine, start=start, end=end, bucket_s=300.0)) == expected(
        events, start, end, 300.0
    )
    one = queries.alloc_ops_over_time(db_engine, start=start, end=end, bucket_s=60.0, instances=["e1"], run_id="r0")
    assert got(one) == expected(events, start, end, 60.0, instance={"e1"}, run_id={"r0"})
    # the trace's count is exact: the rollup's whole minutes inside the window and the raw records at its ends
    trace = queries.alloc_trace(db_engine, start=start, end=end, limit=5)
    assert trace.total == sum(start <= e["ts"] < end for e in events)
    assert [e["ts"] for e in trace.events] == sorted(e["ts"] for e in events if start <= e["ts"] < end)[-5:]
    ooms = queries.alloc_trace(db_engine, start=start, end=end, limit=0, ops=("oom",), instances=["e2"]).total
    assert ooms == sum(start <= e["ts"] < end and e["op"] == "oom" and e["instance"] == "e2" for e in events)
    # a short window reads every record
    short = queries.alloc_ops_over_time(db_engine, start=start, end=start + 600, bucket_s=60.0)
    assert sum(b.events for b in short) == sum(start <= e["ts"] < start + 600 for e in events)


@pytest.mark.parametrize("rolled", [True, False])
def test_the_trace_reads_back_from_the_window_end_until_it_has_the_newest(db_engine: Engine, rolled: bool) -> None:
    """The newest records when the window's rate is no guide: most records early in the window and 3 in its
    last minute, so the slice the mean rate suggests holds too few and is widened; and with the rows stored
    around ingest (no rollup: a count short of the records), which only widens the first slice."""
    events = [*records(2000, seed=4, span=300.0), *records(3, seed=5, start=T0 + 3540.0, span=30.0)]
    if rolled:
        ingest(db_engine, events, "all")
    else:
        rows = parse_batch(ev.body(events), max_events=10_000).rows["alloc"]
        with db_engine.begin() as conn:
            insert_rows(conn, AllocRow.__table__, EVENT_COLUMNS["alloc"], rows)
    start, end = T0 - 30.0, T0 + 3590.0
    newest = sorted(events, key=lambda e: e["ts"])
    for limit in (1, 3, 10, 2003, 5000):
        trace = queries.alloc_trace(db_engine, start=start, end=end, limit=limit)
        assert [(e["ts"], e["instance"]) for e in trace.events] == [
            (e["ts"], e["instance"]) for e in newest[-limit:]
        ], limit
        assert (trace.total == len(events)) is rolled


def test_maintenance_computes_records_stored_before_the_rollup(db_engine: Engine) -> None:
    events = records(1500, seed=2)
    rows = parse_batch(ev.body(events), max_events=10_000).rows["alloc"]
    with db_engine.begin() as conn:  # the raw rows alone, as records stored before the rollup existed
        insert_rows(conn, AllocRow.__table__, EVENT_COLUMNS["alloc"], rows)
    start, end = T0, T0 + 2500.0
    assert queries.alloc_trace(db_engine, start=start, end=end, limit=0).total < len(events)  # not rolled yet
    with db_engine.begin() as conn:
        done = roll_up(
            conn, now=T0 + 3000, first_start=T0 - 600, lookback_s=0, settle_s=60, max_span_s=DAY, kind=ALLOCS_KIND
        )
    assert done is not None
    with db_engine.connect() as conn:  # the roll says how many rows it wrote (PostgreSQL too)
        assert done.buckets == len(conn.execute(select(AllocRollup.bucket_ts)).all()) > 0
    assert queries.alloc_trace(db_engine, start=start, end=end, limit=0).total == len(events)
    assert got(queries.alloc_ops_over_time(db_engine, start=start, end=end, bucket_s=600.0)) == expected(
        events, start, end, 600.0
    )
    # with a watermark, a round reads no raw record (ingest keeps the rollup): one written around ingest in a
    # minute the next round covers stays out of the whole minutes' count
    stray = parse_batch(ev.body([ev.alloc(0, ts=done.end + 30)]), max_events=10).rows["alloc"]
    with db_engine.begin() as conn:
        insert_rows(conn, AllocRow.__table__, EVENT_COLUMNS["alloc"], stray)
    with db_engine.begin() as conn:
        again = roll_up(
            conn, now=T0 + 4000, first_start=T0 - 600, lookback_s=0, settle_s=60, max_span_s=DAY, kind=ALLOCS_KIND
        )
    assert again is not None and again.end > done.end + 30
    assert queries.alloc_trace(db_engine, start=start, end=T0 + 4000.0, limit=0).total == len(events)


@pytest.mark.parametrize("kept", [True, False])
def test_retention_drops_the_rollup_with_the_minute_aggregates(db_engine: Engine, kept: bool) -> None:
    ingest(db_engine, records(200, seed=3), "all")
    result = prune(db_engine, raw_days=1.0, downsample_days=2.0, now=T0 + (1.5 if kept else 3.0) * DAY)
    with db_engine.connect() as conn:
        left = conn.execute(select(AllocRollup.events)).all()
    assert bool(left) is kept and (result.deleted["alloc_rollups"] == 0) is kept


def test_the_trace_sizes_its_first_slice_by_the_rate_at_the_window_end(db_engine: Engine) -> None:
    """A fleet that started late in the window: the hour's mean rate would read most of the window for the newest
    records; the last partial minute's rate (counted for the total anyway) reads a few seconds, and the records
    are the same."""
    end = math.floor((T0 + 3600.0) / 60.0) * 60.0 + 40.0  # 40 s into a minute
    events = [*records(200, seed=6, span=3000.0), *records(3000, seed=7, start=end - 100.0, span=100.0)]
    ingest(db_engine, events, "all")
    lows: list[float] = []

    def slice_start(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if "ORDER BY alloc_events.ts DESC" in statement:
            lows.append(
                min(v for v in (params.values() if isinstance(params, dict) else params) if isinstance(v, float))
            )

    event.listen(db_engine, "before_cursor_execute", slice_start)
    try:
        trace = queries.alloc_trace(db_engine, start=end - 3600.0, end=end, limit=100)
    finally:
        event.remove(db_engine, "before_cursor_execute", slice_start)
    inside = sorted(e["ts"] for e in events if end - 3600.0 <= e["ts"] < end)
    assert [e["ts"] for e in trace.events] == inside[-100:] and trace.total == len(inside)
    # one slice, 4x the 3.3 s the end's 30 records a second fill 100 in (the hour's mean rate: 450 s)
    assert len(lows) == 1 and end - lows[0] < 20.0, (end, lows)
