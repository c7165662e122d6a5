"""EXPLAIN (FORMAT JSON) of what the dashboard's Overview, Latency and KV pages, the rules and `kvpilot status`
run over an hour of a week of day partitions: every scan of a raw table stays in that hour's day (plan-time
pruning), never a scan of the whole partitioned table. PostgreSQL only.

The statements are the ones the read functions really send (recorded with their parameters from the
engine's cursor events), explained with the same parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, insert, text

from alerts.sql_source import SqlSource
from collector import latency_rollup, partitions, queries
from collector.db import make_engine
from collector.ingest import parse_batch, store_batch
from collector.schema import SeriesPoint
from tests.collector import evfactory as ev

pytestmark = pytest.mark.postgres

DAY0 = partitions.day_start(ev.T0)
DAYS = 6
HOUR = DAY0 + 2 * partitions.DAY_S + 12 * 3600  # the window: an hour in the middle of the third day
WINDOW = {"start": HOUR, "end": HOUR + 3600}
THIRD_DAY = partitions.partition_name("x", DAY0 + 2 * partitions.DAY_S)[len("x_") :]  # p20251011


def _day_events(day: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for inst in ("e0", "e1"):
        for i in range(0, 86_400, 240):  # every 4 minutes: 360 of each kind per instance per day
            ts = day + i + (1 if inst == "e1" else 0)
            events += [
                ev.step(i, ts=ts, instance=inst, num_seqs=1 + i % 50),
                ev.request(i, ts=ts, instance=inst, request_id=f"{inst}-{day}-{i}"),
                ev.sample(i, ts=ts, instance=inst, kv_usage=(i % 100) / 100),
                ev.alloc(i, ts=ts, instance=inst, op="oom" if i % 7200 == 0 else "alloc"),
            ]
    return events


@pytest.fixture(scope="module")
def loaded(_pg_schema_url: str) -> Iterator[Engine]:
    engine = make_engine(_pg_schema_url)
    with engine.begin() as conn:
        for table in partitions.PARTITIONED:
            conn.execute(text(f'TRUNCATE "{table}"'))
            for p in partitions.list_partitions(conn, table):
                if p.start is not None:
                    conn.execute(text(f'DROP TABLE "{p.name}"'))
    with engine.connect() as conn:
        partitions.ensure_ahead(conn, now=DAY0 + 3 * partitions.DAY_S, behind_days=3, ahead_days=DAYS - 4)
    for k in range(DAYS):
        day = DAY0 + k * partitions.DAY_S
        raw = ev.body(_day_events(day))
        store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=f"day{k}", content=raw, now=day)
        points = [
            {"instance": "gpu", "name": name, "labels": '{"gpu":"0"}', "ts": day + i, "value": 0.5, "target_id": 1}
            for name in ("utilization", "memory_used_bytes", "memory_total_bytes", "queue_depth")
            for i in range(0, 86_400, 300)
        ]
        with engine.begin() as conn:
            conn.execute(insert(SeriesPoint.__table__), points)
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()
    yield engine
    engine.dispose()


def _recorded(engine: Engine, call: Callable[[], object]) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def record(_conn, _cursor, statement, parameters, _context, _many) -> None:
        seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return seen


def _scans(plan: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(node type, relation) of every scan in a JSON plan."""
    if "Relation Name" in plan:
        yield plan["Node Type"], plan["Relation Name"]
    for child in plan.get("Plans", []):
        yield from _scans(child)


def _raw_scans(engine: Engine, statements: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(node type, relation) of every scan of a raw table or partition in the plans of `statements`."""
    return [
        (node, rel)
        for plan in _plans(engine, statements)
        for node, rel in _scans(plan)
        if rel.split("_p")[0] in partitions.PARTITIONED
    ]


READS: dict[str, Callable[[Engine], object]] = {
    # Overview
    "request_rates": lambda db: queries.request_rates(db, **WINDOW),
    "latency_percentiles": lambda db: queries.latency_percentiles(db, metric="ttft", group_by="instance", **WINDOW),
    "headline_latency": lambda db: queries.headline_latency(db, **WINDOW),
    "throughput_over_time": lambda db: queries.throughput_over_time(db, bucket_s=60, **WINDOW),
    "step_load_over_time": lambda db: queries.step_load_over_time(db, bucket_s=60, **WINDOW),
    "engine_peaks": lambda db: queries.engine_peaks(db, **WINDOW),
    # a fleet's envelope and top lines (max_lines 1 draws the two instances as a fleet)
    "step_load_lines": lambda db: queries.step_load_lines(db, bucket_s=60, max_lines=1, top=1, **WINDOW),
    "latest_samples": lambda db: queries.latest_samples(db, **WINDOW),
    "bucketed utilization": lambda db: queries.bucketed(db, name="utilization", bucket_s=60, **WINDOW),
    # Latency
    "latency_quantiles_over_time": lambda db: queries.latency_quantiles_over_time(
        db, metric="ttft", bucket_s=60, **WINDOW
    ),
    "stage_breakdown_over_time": lambda db: queries.stage_breakdown_over_time(db, bucket_s=60, **WINDOW),
    "latency_histogram": lambda db: queries.latency_histogram(db, metric="e2e", **WINDOW),
    "slowest_requests": lambda db: queries.slowest_requests(db, **WINDOW),
    # KV memory
    "kv_over_time": lambda db: queries.kv_over_time(db, bucket_s=60, **WINDOW),
    "alloc_ops_over_time": lambda db: queries.alloc_ops_over_time(db, bucket_s=60, **WINDOW),
    "alloc_trace": lambda db: queries.alloc_trace(db, **WINDOW),
    "run_gauges_over_time": lambda db: queries.run_gauges_over_time(
        db, names=["kv_usage"], bucket_s=60, run_id="r1", **WINDOW
    ),
    "bucketed kv_usage": lambda db: queries.bucketed(db, name="kv_usage", bucket_s=60, agg="max", **WINDOW),
    # the rules (alerts.sql_source) over their series
    **{
        f"rule {name}": (lambda db, name=name: SqlSource(db, clock=lambda: WINDOW["end"]).points(name, **WINDOW))
        for name in (
            "ttft_p99_seconds",
            "kv_usage",
            "queue_depth",
            "memory_usage",
            "requests_rejected_total",
            "oom_total",
            "events_lost_total",
        )
    },
    # what an instant selector reads (alerts.sql_source.latest): each series' newest sample of the lookback
    **{
        f"rule latest {name}": (
            lambda db, name=name: SqlSource(db, clock=lambda: WINDOW["end"]).latest(
                name, WINDOW["end"] - 300, WINDOW["end"]
            )
        )
        for name in ("kv_usage", "queue_depth", "memory_usage")
    },
    # kvpilot status
    "status diagnose": lambda db: queries.diagnose(db, now=WINDOW["end"], **WINDOW),
}


# Reads that look at an instance's whole history by design. engine_infos (which engine an instance runs:
# has it ever sampled a prefix hit rate, pushed an allocation trace) reads every day of `samples` and
# `alloc_events`; cold_start (did a run start in the window: its first request of all time) every earlier
# day of `requests`, never a later one.
EVERY_DAY = range(DAYS)
EARLIER = range(2)
ALL_TIME = {"status diagnose": {"samples": EVERY_DAY, "alloc_events": EVERY_DAY, "requests": EARLIER}}


# Reads of an hour that read a per-minute rollup instead of any raw row (collector.rollup), and which
ROLLUP_ONLY = {
    "step_load_over_time": {"step_rollups"},
    "alloc_ops_over_time": {"alloc_rollups"},
    "kv_over_time": {"sample_rollups"},
    "step_load_lines": {"step_rollups", "sample_rollups"},  # the sampling engines (kvpilot's) from the sample rollup
}


def _plans(engine: Engine, statements: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    out = []
    with engine.connect() as conn:
        for statement, parameters in statements:
            if statement.lstrip().upper().startswith(("SELECT", "WITH")):
                plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", parameters).scalar_one()
                out.append((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return out


@pytest.mark.parametrize("read", sorted(ROLLUP_ONLY))
def test_an_hour_of_load_and_allocations_reads_the_rollup_by_its_index(loaded: Engine, read: str) -> None:
    statements = _recorded(loaded, lambda: READS[read](loaded))
    assert not _raw_scans(loaded, statements), f"{read} read raw rows"
    scans = [scan for plan in _plans(loaded, statements) for scan in _scans(plan) if scan[1] in ROLLUP_ONLY[read]]
    # by its index (an index scan, or a bitmap heap scan driven by one): never the whole table
    assert {rel for _, rel in scans} == ROLLUP_ONLY[read] and all(node != "Seq Scan" for node, _ in scans), scans


@pytest.mark.parametrize("read", [r for r in READS if r not in ROLLUP_ONLY])
def test_reads_of_an_hour_scan_only_its_day(loaded: Engine, read: str) -> None:
    statements = _recorded(loaded, lambda: READS[read](loaded))
    scans = _raw_scans(loaded, statements)
    assert scans, f"{read} read no raw table"
    allowed = {
        partitions.partition_name(table, DAY0 + k * partitions.DAY_S)
        for table, days in ALL_TIME.get(read, {}).items()
        for k in days
    }
    outside = [(node, rel) for node, rel in scans if not rel.endswith(THIRD_DAY) and rel not in allowed]
    assert not outside, f"{read} scans outside the hour's day partition: {outside}"


def test_an_engine_gauges_newest_samples_are_read_by_index_probes(loaded: Engine) -> None:
    """An instant selector over a fleet's engine gauge reads one sample per instance (the (instance, ts) index,
    newest first), not every sample of the lookback."""
    statements = _recorded(loaded, lambda: queries.latest_points(loaded, name="queue_depth", **WINDOW))
    scans = [scan for plan in _plans(loaded, statements) for scan in _scans(plan) if scan[1].startswith("samples_p")]
    assert scans and all(rel.endswith(THIRD_DAY) for _, rel in scans), scans
    assert all(node in ("Index Scan", "Index Scan Backward", "Index Only Scan") for node, _ in scans), scans


# Fleet-wide latency reads of an hour that read the latency sketch's minutes (collector.queries.latency_sketch)
SKETCHED = ("headline_latency", "latency_quantiles_over_time")


def test_an_hour_of_fleet_latency_reads_the_sketch_by_its_key_and_the_raw_tail_in_its_day(loaded: Engine) -> None:
    done: object = True
    while done is not None:  # ten minutes a transaction: the days before the hour and its first half
        with loaded.begin() as conn:
            done = latency_rollup.roll_up(conn, now=HOUR + 1800, first_start=DAY0)
    with loaded.connect() as conn:
        conn.execute(text("ANALYZE latency_sketches"))
        conn.commit()
    try:
        for read in SKETCHED:
            statements = _recorded(loaded, lambda read=read: READS[read](loaded))
            plans = _plans(loaded, statements)
            sketch_scans = [scan for plan in plans for scan in _scans(plan) if scan[1] == "latency_sketches"]
            # by its key (an index scan, or a bitmap heap scan driven by one): never the whole table
            assert sketch_scans and all(node != "Seq Scan" for node, _ in sketch_scans), (read, sketch_scans)
            outside = [(n, rel) for n, rel in _raw_scans(loaded, statements) if not rel.endswith(THIRD_DAY)]
            assert not outside, f"{read} scans outside the hour's day partition: {outside}"
    finally:
        with loaded.begin() as conn:
            conn.execute(text("DELETE FROM latency_sketches"))
            conn.execute(text("DELETE FROM rollup_watermarks WHERE name = 'latency'"))
