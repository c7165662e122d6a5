"""The per-minute latency sketch: its bins and ranks against exact nearest rank, the roll and late rows on
PostgreSQL (every request counted once), and the reads that use it (percentiles, quantiles over time, the
headline) against the raw rows they stand for."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, Float, cast, func, literal, select

from collector import latency_rollup, queries
from collector.db import make_engine
from collector.ingest import parse_batch, store_batch
from collector.maintenance import Maintenance, MaintenanceMetrics
from collector.queries import latency_sketch as sketch
from collector.retention import DAY, prune
from collector.rollup import watermark
from collector.schema import LatencySketch
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

T0 = ev.T0
SPAN_S = 1800.0  # requests over half an hour: a window the sketch serves (longer than ROLLUP_AFTER_S)
END = T0 + SPAN_S + 100
QS = (0.5, 0.9, 0.99, 1.0)


def exact(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def requests(n: int, *, seed: int, start: float = T0, span: float = SPAN_S) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        frontend = None if i % 5 == 0 else rnd.uniform(0.0, 0.05)
        ttft = rnd.lognormvariate(-2.0, 1.0)
        decode = rnd.lognormvariate(-1.0, 0.5)
        out.append(
            ev.request(
                i,
                instance=f"e{i % 3}",
                request_id=f"q{seed}-{i}",
                ts=start + span * i / n,
                frontend_s=frontend,
                ttft_s=ttft,
                queue_s=0.0 if i % 7 == 0 else rnd.uniform(0.0, 0.2),
                prefill_s=ttft * 0.8,
                decode_s=decode,
                e2e_s=ttft + decode,
                output_tokens=1 if i % 11 == 0 else rnd.randint(2, 200),
                status="finished" if i % 13 else "aborted",
                warmup=i % 17 == 0,
            )
        )
    return out


def ingest(engine: Engine, events: list[dict[str, Any]], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=key, content=raw, now=END)


def counted(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["status"] == "finished" and not e.get("warmup")]


def user_ttft(events: list[dict[str, Any]]) -> list[float]:
    return [e["ttft_s"] + (e["frontend_s"] or 0.0) for e in counted(events)]


def roll(engine: Engine, now: float) -> float | None:
    """Roll until there is nothing left; the watermark. Each roll says how many sketch rows it wrote."""
    while True:
        with engine.begin() as conn:
            before = conn.execute(select(func.count()).select_from(LatencySketch)).scalar_one()
            done = latency_rollup.roll_up(conn, now=now, first_start=T0 - DAY)
            after = conn.execute(select(func.count()).select_from(LatencySketch)).scalar_one()
        if done is None:
            with engine.connect() as conn:
                return watermark(conn, sketch.WATERMARK)
        assert done.buckets == after - before  # no late rows here: every row the roll wrote is new


@pytest.fixture
def pg(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    yield engine
    engine.dispose()


def test_bins_rank_within_gamma_above_the_exact_nearest_rank() -> None:
    rnd = random.Random(1)
    values = [0.0, 0.0, *(rnd.lognormvariate(-3.0, 2.0) for _ in range(5000)), 1e-14, 3e12]
    bins: dict[int, list[float]] = {}
    for v in values:
        b = bins.setdefault(sketch.bin_of(v), [0, 0.0, -math.inf])
        b[0] += 1
        b[1] += v
        b[2] = max(b[2], v)
    merged = sketch.merge([(i, int(c), t, p) for i, (c, t, p) in sorted(bins.items())], (0.0, 0.001, *QS))
    assert merged.count == len(values)
    assert merged.max == max(values)
    assert merged.mean == pytest.approx(sum(values) / len(values))
    for q, got in merged.quantiles.items():
        want = exact(values, q)
        assert got is not None
        assert want <= got <= want * sketch.GAMMA or (want <= 0 and got == want), (q, want, got)


def test_no_values_no_quantiles() -> None:
    merged = sketch.merge([], (0.5,))
    assert (merged.count, merged.mean, merged.max, merged.quantiles) == (0, None, None, {0.5: None})


def test_sql_bins_are_the_python_bins(db_engine: Engine) -> None:
    rnd = random.Random(2)
    values = [0.0, -1.0, 1e-15, 1.0, 1.02, 5e11, *(rnd.lognormvariate(-2.0, 2.0) for _ in range(200))]
    stmt = select(*(sketch.bin_expr(cast(literal(v), Float), db_engine.dialect.name) for v in values))
    with db_engine.connect() as conn:
        got = conn.execute(stmt).one()
    want = [sketch.bin_of(v) for v in values]
    # a value on a bin's edge may fall either side in floating point: within one bin, and exact elsewhere
    assert sum(g != w for g, w in zip(got, want, strict=True)) <= 1
    assert all(abs(g - w) <= 1 for g, w in zip(got, want, strict=True))


@pytest.mark.postgres
def test_fleet_percentiles_read_the_sketch_and_the_raw_tail_after_it(pg: Engine) -> None:
    events = requests(3000, seed=3)
    for k in range(0, len(events), 500):
        ingest(pg, events[k : k + 500], f"b{k}")
    through = roll(pg, now=T0 + 1200)
    assert through == math.floor((T0 + 1200 - latency_rollup.SETTLE_S) / 60) * 60
    with pg.connect() as conn:
        assert conn.execute(select(func.count()).select_from(LatencySketch)).scalar_one() > 0
    [stats] = queries.latency_percentiles(pg, start=T0, end=END, metric="ttft", quantiles=QS, group_by="all")
    values = user_ttft(events)
    assert stats.count == len(values)  # the sketch's minutes and the raw rows after them, each once
    assert stats.max == pytest.approx(max(values))
    assert stats.mean == pytest.approx(sum(values) / len(values))
    for q in QS:
        assert exact(values, q) <= stats.quantiles[q] <= exact(values, q) * sketch.GAMMA
    # one instance reads its rows by index, exact
    [one] = queries.latency_percentiles(pg, start=T0, end=END, metric="ttft", quantiles=QS, instances=["e1"])
    e1 = user_ttft([e for e in events if e["instance"] == "e1"])
    assert one.quantiles[0.99] == pytest.approx(exact(e1, 0.99))
    # tpot: requests of one output token have none
    [tpot] = queries.latency_percentiles(pg, start=T0, end=END, metric="tpot", quantiles=QS, group_by="all")
    want = [e["decode_s"] / (e["output_tokens"] - 1) for e in counted(events) if e["output_tokens"] > 1]
    assert tpot.count == len(want)


@pytest.mark.postgres
def test_late_rows_are_added_once_and_a_second_roll_adds_nothing(pg: Engine) -> None:
    events = requests(1200, seed=4)
    ingest(pg, events, "first")
    through = roll(pg, now=T0 + SPAN_S + 60)
    assert through is not None and through > T0 + SPAN_S
    late = requests(300, seed=5, span=600.0)  # the half hour's first ten minutes, stored after they were rolled
    ingest(pg, late, "late")
    assert roll(pg, now=T0 + SPAN_S + 60) == through
    with pg.connect() as conn:
        sketched = conn.execute(select(func.sum(LatencySketch.count)).where(LatencySketch.metric == "e2e")).scalar_one()
    assert sketched == len(counted(events)) + len(counted(late))
    [stats] = queries.latency_percentiles(pg, start=T0, end=END, metric="e2e", quantiles=QS, group_by="all")
    values = [e["e2e_s"] + (e["frontend_s"] or 0.0) for e in counted(events + late)]
    assert stats.count == len(values)
    assert exact(values, 0.99) <= stats.quantiles[0.99] <= exact(values, 0.99) * sketch.GAMMA


@pytest.mark.postgres
def test_quantiles_over_time_per_minute_buckets_count_every_request(pg: Engine) -> None:
    events = requests(2000, seed=6)
    ingest(pg, events, "all")
    roll(pg, now=T0 + 1000)
    got = queries.latency_quantiles_over_time(pg, start=T0, end=END, bucket_s=300.0, metric="ttft", quantiles=QS)
    by_bucket: dict[float, list[float]] = {}
    for e in counted(events):
        by_bucket.setdefault(math.floor(e["ts"] / 300.0) * 300.0, []).append(e["ttft_s"] + (e["frontend_s"] or 0.0))
    assert [b.ts for b in got] == sorted(by_bucket)
    for b in got:
        values = by_bucket[b.ts]
        assert b.count == len(values)
        assert exact(values, 0.99) <= b.quantiles[0.99] <= exact(values, 0.99) * sketch.GAMMA
    # a bucket that is no whole number of minutes reads every row, exact
    odd = queries.latency_quantiles_over_time(pg, start=T0, end=END, bucket_s=90.0, metric="ttft", quantiles=(0.99,))
    assert sum(b.count for b in odd) == len(counted(events))


@pytest.mark.postgres
def test_headline_says_it_reads_the_sketch_and_counts_the_unmeasured(pg: Engine) -> None:
    events = requests(1500, seed=7)
    ingest(pg, events, "all")
    raw = queries.headline_latency(pg, start=T0, end=END)
    roll(pg, now=T0 + 1500)
    rolled = queries.headline_latency(pg, start=T0, end=END)
    assert sketch.SKETCH_NOTE not in raw.source and sketch.SKETCH_NOTE in rolled.source
    assert (rolled.requests, rolled.unmeasured) == (raw.requests, raw.unmeasured) != (0, 0)
    assert raw.ttft_p99_s is not None and rolled.ttft_p99_s is not None
    assert raw.ttft_p99_s <= rolled.ttft_p99_s <= raw.ttft_p99_s * sketch.GAMMA
    # a short window reads every row
    short = queries.headline_latency(pg, start=T0, end=T0 + 600)
    assert sketch.SKETCH_NOTE not in short.source


def test_sqlite_rolls_nothing_and_reads_exact(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        events = requests(600, seed=8)
        ingest(engine, events, "all")
        assert roll(engine, now=END) is None
        [stats] = queries.latency_percentiles(engine, start=T0, end=END, metric="ttft", quantiles=QS, group_by="all")
        assert stats.quantiles[0.99] == pytest.approx(exact(user_ttft(events), 0.99))
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_retention_keeps_the_sketch_as_long_as_the_minute_aggregates(pg: Engine) -> None:
    ingest(pg, requests(300, seed=9), "all")
    roll(pg, now=END)
    result = prune(pg, raw_days=1.0, downsample_days=2.0, now=T0 + 1.5 * DAY)
    assert result.deleted.get("latency_sketches") == 0
    result = prune(pg, raw_days=1.0, downsample_days=2.0, now=T0 + 3 * DAY)
    assert result.deleted["latency_sketches"] > 0


@pytest.mark.postgres
def test_maintenance_rolls_the_sketch_in_its_round_and_between_rounds(pg: Engine, pg_url: str) -> None:
    ingest(pg, requests(600, seed=10), "all")
    clock = [T0 + 600.0]
    settings = CollectorSettings(db_url=pg_url, raw_retention_days=3.0, partitions_ahead_days=2)
    metrics = MaintenanceMetrics(CollectorRegistry())
    job = Maintenance(pg, settings, metrics=metrics, clock=lambda: clock[0])
    result = job.run_once()
    assert result is not None and result.latency_sketch is not None
    first = result.latency_sketch.end
    assert first == math.floor((clock[0] - latency_rollup.SETTLE_S) / 60) * 60
    assert job.sketch_once() is None  # no minute closed since
    clock[0] += 120.0
    later = job.sketch_once()
    assert later is not None and later.end == first + 120.0
    assert metrics.sketch_through._value.get() == later.end
