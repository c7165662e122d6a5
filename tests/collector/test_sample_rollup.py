"""The per-minute sample rollup: ingest keeps it, maintenance computes what is older than it, and the long windows
of the KV page's usage chart and of the Overview's sampling engines read it with the means of every raw sample."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from sqlalchemy import Engine, select

from collector import queries
from collector.bulk import insert_rows
from collector.ingest import EVENT_COLUMNS, parse_batch, store_batch
from collector.queries.step_rollup import ROLLUP_AFTER_S
from collector.retention import DAY, prune
from collector.rollup import SAMPLES_KIND, roll_up
from collector.schema import SampleRollup, SampleRow
from tests.collector import evfactory as ev

T0 = ev.T0
GAUGES = ("kv_usage", "cold_usage", "fragmentation", "internal_waste")


def samples(n: int, *, seed: int, start: float = T0, span: float = 2400.0) -> list[dict[str, Any]]:
    """Samples of three instances over two runs; each gauge missing from some (an engine without it)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        gauges = {g: (None if rnd.random() < 0.15 else rnd.random()) for g in GAUGES}
        out.append(ev.sample(i, ts=start + span * i / n, instance=f"e{i % 3}", run_id=f"r{i % 2}", **gauges))
    return out


def ingest(engine: Engine, events: list[dict[str, Any]], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=key, content=raw, now=T0 + 3000)


def expected(events: list[dict[str, Any]], start: float, end: float, bucket_s: float, **only: Any) -> dict:
    """instance -> [(bucket, kv, cold, frag, waste, samples)] over the minutes the window touches, whole."""
    lo, hi = math.floor(start / 60.0) * 60.0, math.ceil(end / 60.0) * 60.0
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for e in events:
        if lo <= e["ts"] < hi and all(e[k] in v for k, v in only.items()):
            by.setdefault((e["instance"], math.floor(e["ts"] / bucket_s) * bucket_s), []).append(e)
    out: dict[str, list[tuple]] = {}
    for (inst, ts), es in sorted(by.items()):
        means = []
        for g in GAUGES:
            values = [e[g] for e in es if e[g] is not None]
            means.append(sum(values) / len(values) if values else None)
        out.setdefault(inst, []).append((ts, *means, len(es)))
    return out


def got(buckets: dict[str, list[queries.KvBucket]]) -> dict:
    return {
        inst: [(b.ts, b.kv_usage, b.cold_usage, b.fragmentation, b.internal_waste, b.samples) for b in bs]
        for inst, bs in buckets.items()
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for inst in a:
        assert len(a[inst]) == len(b[inst]), inst
        for x, y in zip(a[inst], b[inst], strict=True):
            assert x == pytest.approx(y), (inst, x, y)


def test_ingest_keeps_the_rollup_and_long_windows_read_it(db_engine: Engine) -> None:
    events = samples(3000, seed=1)
    for k in range(0, 3000, 700):  # minutes straddle the batches
        ingest(db_engine, events[k : k + 700], f"b{k}")
    ingest(db_engine, events[:700], "b0")  # a retry: a duplicate, added once
    start, end = T0 + 125.0, T0 + 2300.5  # neither on a minute
    assert end - start > ROLLUP_AFTER_S
    assert_same(
        got(queries.kv_over_time(db_engine, start=start, end=end, bucket_s=300.0)), expected(events, start, end, 300.0)
    )
    one = queries.kv_over_time(db_engine, start=start, end=end, bucket_s=60.0, instances=["e1"], run_id="r0")
    assert_same(got(one), expected(events, start, end, 60.0, instance={"e1"}, run_id={"r0"}))
    # the rollup is what a long window reads: a changed rollup row shows (the raw samples hold the truth)
    with db_engine.begin() as conn:
        conn.execute(SampleRollup.__table__.update().values(samples=SampleRollup.samples + 1))
    bumped = queries.kv_over_time(db_engine, start=start, end=end, bucket_s=300.0)
    assert sum(b.samples for bs in bumped.values() for b in bs) > sum(
        n for bs in expected(events, start, end, 300.0).values() for *_, n in bs
    )
    # a short window, or buckets of no whole minutes, read every sample in it, exact at its edges
    short_start, short_end = T0 + 125.0, T0 + 700.0
    short = queries.kv_over_time(db_engine, start=short_start, end=short_end, bucket_s=60.0)
    inside = [e for e in events if short_start <= e["ts"] < short_end]
    assert_same(got(short), expected(inside, short_start, short_end, 60.0))


def test_long_windows_name_the_sampling_engines_from_the_rollup(db_engine: Engine) -> None:
    events = samples(600, seed=4)
    ingest(db_engine, [e for e in events if e["instance"] != "e2"], "some")
    start, end = T0, T0 + 2400.0
    assert queries.step_facts(db_engine, start=start, end=end).pushing == {"e0", "e1"}
    assert queries.step_facts(db_engine, start=start, end=end, instances=["e1"]).pushing == {"e1"}
    assert queries.step_facts(db_engine, start=start, end=end, run_id="r1").pushing == {"e0", "e1"}
    with db_engine.begin() as conn:  # the rollup is what names them: a row of e2 makes it a sampling engine
        conn.execute(
            SampleRollup.__table__.insert().values(
                instance="e2",
                run_id="r0",
                bucket_ts=T0 + 600,
                samples=1,
                **{f"{g}_{p}": 0 for g in GAUGES for p in ("sum", "n")},
            )
        )
    assert queries.step_facts(db_engine, start=start, end=end).pushing == {"e0", "e1", "e2"}
    assert queries.step_facts(db_engine, start=start, end=start + 600).pushing == {"e0", "e1"}  # short: raw


def test_maintenance_computes_samples_stored_before_the_rollup(db_engine: Engine) -> None:
    events = samples(1500, seed=2)
    rows = parse_batch(ev.body(events), max_events=10_000).rows["sample"]
    with db_engine.begin() as conn:  # the raw rows alone, as samples stored before the rollup existed
        insert_rows(conn, SampleRow.__table__, EVENT_COLUMNS["sample"], rows)
    start, end = T0, T0 + 2500.0
    assert queries.kv_over_time(db_engine, start=start, end=end, bucket_s=600.0) == {}  # not rolled yet
    with db_engine.begin() as conn:
        done = roll_up(
            conn, now=T0 + 3000, first_start=T0 - 600, lookback_s=0, settle_s=60, max_span_s=DAY, kind=SAMPLES_KIND
        )
    assert done is not None
    with db_engine.connect() as conn:  # the roll says how many rows it wrote (PostgreSQL too)
        assert done.buckets == len(conn.execute(select(SampleRollup.bucket_ts)).all()) > 0
    assert_same(
        got(queries.kv_over_time(db_engine, start=start, end=end, bucket_s=600.0)), expected(events, start, end, 600.0)
    )


@pytest.mark.parametrize("kept", [True, False])
def test_retention_drops_the_rollup_with_the_minute_aggregates(db_engine: Engine, kept: bool) -> None:
    ingest(db_engine, samples(200, seed=3), "all")
    result = prune(db_engine, raw_days=1.0, downsample_days=2.0, now=T0 + (1.5 if kept else 3.0) * DAY)
    with db_engine.connect() as conn:
        left = conn.execute(select(SampleRollup.samples)).all()
    assert bool(left) is kept and (result.deleted["sample_rollups"] == 0) is kept
