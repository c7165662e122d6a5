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
from collector.queries.request_rates import STAGES
from collector.retention import DAY, prune
from collector.rollup import watermark
from collector.schema import LatencySketch, RequestStageMinute
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


def staged(n: int, *, seed: int, start: float = T0, span: float = SPAN_S) -> list[dict[str, Any]]:
    """`requests` with swaps, preemptions and swapped seconds, some longer than the decode (clamped at 0)."""
    rnd = random.Random(seed)
    out = requests(n, seed=seed, start=start, span=span)
    for e in out:
        swapped = rnd.random() < 0.3
        e["swap_s"] = rnd.uniform(0.0, 2.0 * e["decode_s"]) if swapped else 0.0
        e["swaps"] = rnd.randint(1, 3) if swapped else 0
        e["preemptions"] = rnd.randint(0, 2)
    return out


def stage_truth(events: list[dict[str, Any]], bucket_s: float) -> dict[float, dict[str, float]]:
    """The stage breakdown's buckets computed from the events themselves."""
    by: dict[float, list[dict[str, Any]]] = {}
    for e in counted(events):
        by.setdefault(math.floor(e["ts"] / bucket_s) * bucket_s, []).append(e)
    out = {}
    for ts, es in by.items():
        n = len(es)
        out[ts] = {
            "requests": n,
            "queue_s": sum(e["queue_s"] for e in es) / n,
            "decode_excl_swap_s": sum(max(e["decode_s"] - e["swap_s"], 0.0) for e in es) / n,
            "swap_s": sum(e["swap_s"] for e in es) / n,
            "e2e_s": sum(e["e2e_s"] + (e["frontend_s"] or 0.0) for e in es) / n,
            "frontend_s": sum(e["frontend_s"] or 0.0 for e in es) / n,
            "swaps": sum(e["swaps"] for e in es),
            "preemptions": sum(e["preemptions"] for e in es),
        }
    return out


def assert_stages(got: list[queries.StageBucket], want: dict[float, dict[str, float]]) -> None:
    assert [b.ts for b in got] == sorted(want)
    for b in got:
        for field, value in want[b.ts].items():
            assert getattr(b, field) == pytest.approx(value), (b.ts, field)


def roll_stages(engine: Engine, now: float) -> float | None:
    """Roll the stage sums until there is nothing left; their watermark."""
    while True:
        with engine.begin() as conn:
            if latency_rollup.roll_stages(conn, now=now, first_start=T0 - DAY) is None:
                return watermark(conn, STAGES)


@pytest.mark.postgres
def test_fleet_stage_breakdown_reads_the_stage_minutes_and_counts_late_rows_once(pg: Engine) -> None:
    events = staged(2400, seed=11)
    for k in range(0, len(events), 600):
        ingest(pg, events[k : k + 600], f"b{k}")
    raw = queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0)
    assert_stages(raw, stage_truth(events, 300.0))  # nothing rolled: every raw row
    through = roll_stages(pg, now=T0 + 1200)
    assert through == math.floor((T0 + 1200 - latency_rollup.SETTLE_S) / 60) * 60
    with pg.connect() as conn:
        minutes = conn.execute(select(func.count()).select_from(RequestStageMinute)).scalar_one()
        assert minutes == len({math.floor(e["ts"] / 60) for e in counted(events) if e["ts"] < through})
        # the rollup is read: a changed stage minute shows in the breakdown (the raw rows still hold the truth)
    rolled = queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0)
    assert_stages(rolled, stage_truth(events, 300.0))  # the stage minutes before the watermark, raw rows after
    late = staged(400, seed=12, span=600.0)  # the first ten minutes again, stored after they were rolled
    ingest(pg, late, "late")
    assert roll_stages(pg, now=T0 + 1200) == through  # nothing new to roll: the late rows were added by ingest
    assert_stages(
        queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0), stage_truth(events + late, 300.0)
    )
    with pg.begin() as conn:  # the minutes are what the fleet-wide window reads
        conn.execute(RequestStageMinute.__table__.update().values(swaps=RequestStageMinute.swaps + 1000))
    bumped = queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0)
    assert sum(b.swaps for b in bumped) == sum(b.swaps for b in rolled) + 1000 * minutes + sum(
        e["swaps"] for e in counted(late)
    )
    # one instance, a short window or a bucket of no whole minutes read the raw rows, exact
    one = queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0, instances=["e1"])
    assert_stages(one, stage_truth([e for e in events + late if e["instance"] == "e1"], 300.0))
    odd = queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=90.0)
    assert_stages(odd, stage_truth(events + late, 90.0))


@pytest.mark.postgres
def test_stage_minutes_roll_from_the_oldest_request_when_the_sketch_is_ahead(pg: Engine, pg_url: str) -> None:
    """A database that had the sketch before the stage minutes existed rolls them from its first request."""
    events = staged(900, seed=13)
    ingest(pg, events, "all")
    assert roll(pg, now=END) is not None  # the sketch alone, as before the stage minutes
    with pg.connect() as conn:
        assert watermark(conn, STAGES) is None
    settings = CollectorSettings(db_url=pg_url, raw_retention_days=3.0, partitions_ahead_days=2)
    metrics = MaintenanceMetrics(CollectorRegistry())
    result = Maintenance(pg, settings, metrics=metrics, clock=lambda: END).run_once()
    assert result is not None and result.stage_minutes is not None and result.latency_sketch is None
    assert metrics.stages_through._value.get() == result.stage_minutes.end
    assert_stages(queries.stage_breakdown_over_time(pg, start=T0, end=END, bucket_s=300.0), stage_truth(events, 300.0))
    result = prune(pg, raw_days=1.0, downsample_days=2.0, now=T0 + 3 * DAY)
    assert result.deleted["request_stage_minutes"] > 0
