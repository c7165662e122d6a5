"""Day partitions of the raw tables (PostgreSQL), the maintenance round, retention by dropping days, the step
rollup and the reads that use it. Partition tests run on PostgreSQL only (SQLite has none); the rollup runs
on both."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, func, select, text
from typer.testing import CliRunner

from collector import partitions, queries
from collector.bulk import insert_rows
from collector.db import alembic_config, make_engine, upgrade
from collector.ingest import EVENT_COLUMNS, parse_batch, store_batch
from collector.maintenance import Maintenance, MaintenanceMetrics, run_round
from collector.queries.step_rollup import ROLLUP_AFTER_S, ROLLUP_NOTE
from collector.retention import DAY, prune
from collector.rollup import roll_up
from collector.schema import DownsampledPoint, StepRollup, StepRow
from collector.settings import CollectorSettings
from kvpilot.cli_collector import db_app
from tests.collector import evfactory as ev

DAY0 = partitions.day_start(ev.T0)  # 2025-10-09 00:00 UTC
PRE = "f2d8a4c6b310"
PK_STEPS = (
    "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
    " WHERE conname = 'pk_steps' AND connamespace = current_schema()::regnamespace"
)


def ingest(engine: Engine, events: list[dict], key: str, now: float) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=10_000), idempotency_key=key, content=raw, now=now)


def where_rows_are(engine: Engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text(f'SELECT tableoid::regclass::text, count(*) FROM "{table}" GROUP BY 1')).all()
    return {name: n for name, n in rows}


def settings(url: str) -> CollectorSettings:
    return CollectorSettings(db_url=url, raw_retention_days=3.0, partitions_ahead_days=2)


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    """An engine on the session's PostgreSQL schema with no day partitions (other tests' are dropped)."""
    engine = make_engine(pg_url)
    with engine.begin() as conn:
        for table in partitions.PARTITIONED:
            for p in partitions.list_partitions(conn, table):
                if p.start is not None:
                    conn.execute(text(f'DROP TABLE "{p.name}"'))
    yield engine
    engine.dispose()


def test_migration_partitions_stored_rows_and_downgrade_unpartitions_them(pg_url: str, pg_engine: Engine) -> None:
    cfg = alembic_config(pg_url)
    command.downgrade(cfg, PRE)
    engine = make_engine(pg_url)
    insert = text(
        "INSERT INTO steps (instance, run_id, ts, step, duration_s, forward_s, num_seqs, prefill_tokens,"
        " decode_tokens, kv_blocks_used, kv_blocks_total, queue_depth, busy_s, preemptions, swapped_seqs, warmup)"
        " VALUES ('e0', 'r1', :ts, 1, 0.01, 0.01, 4, 1, 1, 5, 10, 0, 0.01, 0, 0, false)"
    )
    try:
        with engine.begin() as conn:
            conn.execute(insert, [{"ts": DAY0 + 10}, {"ts": DAY0 + 20}, {"ts": DAY0 + DAY + 5}])
        upgrade(pg_url)
        with engine.begin() as conn:
            assert partitions.is_partitioned(conn, "steps")
            assert all(partitions.is_partitioned(conn, t) for t in partitions.PARTITIONED)
            days = [p.name for p in partitions.list_partitions(conn, "steps")]
            assert days == ["steps_p20251009", "steps_p20251010", "steps_default"]
            key = conn.execute(text(PK_STEPS)).scalar_one()
            assert key == "PRIMARY KEY (id, ts)"
            indexes = conn.execute(
                text("SELECT indexname FROM pg_indexes WHERE tablename = 'steps' AND schemaname = current_schema()")
            ).scalars()
            assert {"ix_steps_instance_ts", "ix_steps_run_id_ts", "brin_steps_ts", "pk_steps"} <= set(indexes)
            conn.execute(insert, {"ts": DAY0 + 30})  # the id sequence came along: no clash with stored ids
            ids = conn.execute(text("SELECT id FROM steps ORDER BY id")).scalars().all()
        assert ids == [1, 2, 3, 4]
        assert where_rows_are(engine, "steps") == {"steps_p20251009": 3, "steps_p20251010": 1}

        command.downgrade(cfg, PRE)
        with engine.connect() as conn:
            assert not partitions.is_partitioned(conn, "steps")
            assert conn.execute(text("SELECT count(*) FROM steps")).scalar_one() == 4
            left = conn.execute(text("SELECT to_regclass('steps_default'), to_regclass('steps_p20251009')")).one()
            assert left == (None, None)
            key = conn.execute(text(PK_STEPS)).scalar_one()
        assert key == "PRIMARY KEY (id)"
    finally:
        upgrade(pg_url)
        engine.dispose()


def test_a_row_without_its_day_lands_in_default_and_maintenance_rehomes_it(pg_url: str, pg_engine: Engine) -> None:
    now = DAY0 + 3600
    registry = CollectorRegistry()
    maintenance = Maintenance(pg_engine, settings(pg_url), metrics=MaintenanceMetrics(registry), clock=lambda: now)
    made = maintenance.run_once()
    assert made is not None and "steps_p20251011" in made.created  # two days ahead
    assert "steps_p20251008" in made.created and "steps_p20251007" not in made.created  # one behind
    assert registry.get_sample_value("kvpilot_collector_partitions_created_total") == 4 * len(partitions.PARTITIONED)

    ingest(pg_engine, [ev.step(0, ts=now), ev.sample(0, ts=now)], "today", now)
    later = DAY0 + 9 * DAY  # no partition for that day yet: the batch is stored all the same
    ingest(pg_engine, [ev.step(1, ts=later), ev.step(2, ts=later + 1), ev.request(0, ts=later)], "later", later)
    assert where_rows_are(pg_engine, "steps") == {"steps_p20251009": 1, "steps_default": 2}
    with pg_engine.connect() as conn:
        assert partitions.default_rows(conn)["steps"] == 2

    maintenance.clock = lambda: later
    again = maintenance.run_once()
    assert again is not None and again.default_rows == dict.fromkeys(partitions.PARTITIONED, 0)
    assert where_rows_are(pg_engine, "steps") == {"steps_p20251009": 1, "steps_p20251018": 2}
    assert where_rows_are(pg_engine, "requests") == {"requests_p20251018": 1}
    assert registry.get_sample_value("kvpilot_collector_partition_default_rows", {"table": "steps"}) == 0
    assert registry.get_sample_value("kvpilot_collector_maintenance_runs_total", {"result": "ok"}) == 2


def test_maintenance_summarizes_the_brin_ranges_written_since_its_last_round(pg_url: str, pg_engine: Engine) -> None:
    """An unsummarized BRIN range matches every window (a read of the last hour scanned the day's pages written
    since the last VACUUM): each round summarizes what was written to yesterday's and today's partitions."""
    now = DAY0 + 3600
    registry = CollectorRegistry()
    maintenance = Maintenance(pg_engine, settings(pg_url), metrics=MaintenanceMetrics(registry), clock=lambda: now)
    first = maintenance.run_once()
    assert first is not None and first.brin_ranges == 0  # empty partitions
    for k in range(6):  # a few MB: PostgreSQL summarizes whole ranges of 128 pages, never the last partial one
        ingest(pg_engine, [ev.step(i, ts=now + k * 600 + i * 0.1) for i in range(5000)], f"brin-{k}", now)
    second = maintenance.run_once()
    assert second is not None and second.brin_ranges > 0
    assert registry.get_sample_value("kvpilot_collector_brin_ranges_summarized_total") == second.brin_ranges
    third = maintenance.run_once()
    assert third is not None and third.brin_ranges == 0  # nothing new since


def test_maintenance_runs_one_collector_at_a_time(pg_url: str, pg_engine: Engine) -> None:
    with pg_engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": 0x6B76_7069_6D61})
        assert run_round(pg_engine, settings(pg_url), now=DAY0).skipped
        holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": 0x6B76_7069_6D61})
        holder.commit()
    assert not run_round(pg_engine, settings(pg_url), now=DAY0).skipped


def test_prune_drops_whole_days_and_downsamples_them(pg_url: str, pg_engine: Engine) -> None:
    now = DAY0 + 10 * DAY + 3600
    with pg_engine.begin() as conn:
        for k in range(4):
            partitions.create_day(conn, "steps", DAY0 + k * DAY)
    for k in range(4):
        day = DAY0 + k * DAY
        ingest(pg_engine, [ev.step(i, ts=day + 60 * i, duration_s=0.02) for i in range(5)], f"d{k}", day)
    ingest(pg_engine, [ev.step(9, ts=DAY0 - 5)], "stray", DAY0 - 5)  # no partition: in the DEFAULT one

    result = prune(pg_engine, raw_days=7.5, downsample_days=90, now=now)  # cutoff: the start of DAY0 + 2

    assert result.raw_cutoff == DAY0 + 2 * DAY
    assert result.deleted["steps"] == 11
    with pg_engine.connect() as conn:
        kept = [p.name for p in partitions.list_partitions(conn, "steps")]
        assert kept == ["steps_p20251011", "steps_p20251012", "steps_default"]
        assert conn.execute(select(func.count()).select_from(StepRow.__table__)).scalar_one() == 10
        d = DownsampledPoint.__table__.c
        counted = select(func.sum(d.count)).where(d.name == "step_duration_seconds")
        assert conn.execute(counted).scalar_one() == 11  # every dropped step is in the 1-minute aggregates


def _steps(rng: random.Random, start: float, n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append(
            ev.step(
                i,
                ts=start + i * 7.3,
                instance=rng.choice(["e0", "e1"]),
                run_id=rng.choice(["r1", "r2"]),
                duration_s=rng.uniform(0.005, 0.05),
                num_seqs=rng.randint(1, 64),
                queue_depth=rng.randint(0, 30),
                kv_blocks_used=rng.randint(0, 100),
                warmup=i % 17 == 0,
            )
        )
    return out


def _expected_minutes(steps: list[dict], width: float = 60.0) -> dict[tuple[str, str, float], list]:
    """The rollup computed here from the steps: per (instance, run, bucket) count, summed duration and maxima."""
    out: dict[tuple[str, str, float], list] = {}
    for s in steps:
        if s.get("warmup"):
            continue
        agg = out.setdefault((s["instance"], s["run_id"], (s["ts"] // width) * width), [0, 0.0, 0.0, 0, 0])
        agg[0] += 1
        agg[1] += s["duration_s"]
        agg[2] = max(agg[2], s["kv_blocks_used"] / s["kv_blocks_total"])
        agg[3] = max(agg[3], s["num_seqs"])
        agg[4] = max(agg[4], s["queue_depth"])
    return out


def _rollup_rows(engine: Engine) -> dict[tuple[str, str, float], list]:
    r = StepRollup.__table__.c
    cols = (r.instance, r.run_id, r.bucket_ts, r.steps, r.duration_sum, r.kv_usage_max, r.running_max, r.waiting_max)
    with engine.connect() as conn:
        rows = conn.execute(select(*cols)).all()
    return {(i, run, b): [n, pytest.approx(dur), pytest.approx(kv), rm, wm] for i, run, b, n, dur, kv, rm, wm in rows}


def test_ingest_keeps_the_rollup_and_maintenance_recomputes_the_same(db_engine: Engine) -> None:
    """Each batch adds its steps to their minutes (batches that share a minute add up, a batch sent twice is
    stored and added once); maintenance's recompute from the raw steps gives the same rows, again and again."""
    start = DAY0 + 600
    steps = _steps(random.Random(7), start, 400)
    for k, (a, b) in enumerate(((0, 150), (150, 301), (301, 400))):  # minutes straddle the batches
        ingest(db_engine, steps[a:b], f"steps-{k}", steps[-1]["ts"])
    ingest(db_engine, steps[150:301], "steps-1", steps[-1]["ts"])  # a retry of batch 1: a duplicate
    expected = _expected_minutes(steps)
    assert _rollup_rows(db_engine) == expected

    with db_engine.begin() as conn:
        done = roll_up(conn, now=start + 4000, first_start=start, lookback_s=0, settle_s=60, max_span_s=DAY)
    assert done is not None and done.end == start + 3900
    assert _rollup_rows(db_engine) == expected
    with db_engine.begin() as conn:  # idempotent: the same minutes again give the same rows
        roll_up(conn, now=start + 4000, first_start=start, lookback_s=3900, settle_s=60, max_span_s=DAY)
    assert _rollup_rows(db_engine) == expected


def test_maintenance_reads_no_raw_step_once_ingest_keeps_the_rollup(db_engine: Engine) -> None:
    """With a watermark, a round only moves it on (ingest added every step it stored); a step written around
    ingest stays out of the rollup until a round with a lookback recomputes its minute."""
    start = DAY0 + 600
    steps = _steps(random.Random(5), start, 200)
    ingest(db_engine, steps, "steps", steps[-1]["ts"])
    with db_engine.begin() as conn:
        first = roll_up(conn, now=start + 1000, first_start=start, lookback_s=0, settle_s=60, max_span_s=DAY)
    assert first is not None  # no watermark yet: computed from the raw steps
    expected = _expected_minutes(steps)
    assert _rollup_rows(db_engine) == expected
    # a step stored around ingest (a raw COPY, a restore) in a minute the next round covers
    live = next(s for s in steps if not s.get("warmup"))
    stray = {**live, "ts": first.end + 30, "kv_blocks_used": live["kv_blocks_total"]}
    with db_engine.begin() as conn:  # the raw rows alone, as a bench's COPY writes them
        rows = parse_batch(ev.body([stray]), max_events=10).rows["step"]
        insert_rows(conn, StepRow.__table__, EVENT_COLUMNS["step"], rows)
    with db_engine.begin() as conn:
        moved = roll_up(conn, now=start + 2000, first_start=start, lookback_s=0, settle_s=60, max_span_s=DAY)
    assert moved is not None and moved.buckets == 0 and moved.end > stray["ts"]
    assert _rollup_rows(db_engine) == expected  # its minute was not recomputed: the stray step is not in it
    with db_engine.begin() as conn:  # a repair: the lookback recomputes those minutes from every raw step
        roll_up(conn, now=start + 2000, first_start=start, lookback_s=3000, settle_s=60, max_span_s=DAY)
    assert _rollup_rows(db_engine) == _expected_minutes([*steps, stray])


def _peaks(p: queries.EnginePeaks) -> tuple[Any, ...]:
    return p.kv_usage_peak, p.running_peak, p.steps  # waiting: from request rows for engines without samples


def _peaks_of(steps: list[dict], lo: float, hi: float) -> tuple[Any, ...]:
    mine = [s for s in steps if lo <= s["ts"] < hi and not s.get("warmup")]
    kv = max(s["kv_blocks_used"] / s["kv_blocks_total"] for s in mine)
    return kv, max(s["num_seqs"] for s in mine), len(mine)


def test_long_windows_read_the_rollup_in_whole_minutes(db_engine: Engine) -> None:
    start = DAY0 + 600
    steps = _steps(random.Random(11), start, 3000)  # about six hours
    ingest(db_engine, steps, "steps", steps[-1]["ts"])
    window = {"start": start - 3600, "end": start + 8 * 3600}
    rolled = queries.engine_peaks(db_engine, **window)
    assert _peaks(rolled) == pytest.approx(_peaks_of(steps, *window.values())) and ROLLUP_NOTE in rolled.source
    charted = queries.step_load_over_time(db_engine, bucket_s=600, **window)
    expected = {}
    for (name, _, ts), (n, _, kv, running, waiting) in sorted(_expected_minutes(steps, 600.0).items()):
        b = expected.setdefault(name, {}).setdefault(ts, [0, 0.0, 0, 0])
        b[0], b[1], b[2], b[3] = b[0] + n, max(b[1], kv), max(b[2], running), max(b[3], waiting)
    got = {k: {b.ts: [b.steps, pytest.approx(b.kv_usage), b.running, b.waiting] for b in v} for k, v in charted.items()}
    assert got == expected and all(b.rollup for bs in charted.values() for b in bs)

    # a window off the minute is read in whole minutes: its first and last minutes whole
    hour = queries.engine_peaks(db_engine, start=start + 30, end=start + 3630)
    assert _peaks(hour) == pytest.approx(_peaks_of(steps, start, start + 3660)) and ROLLUP_NOTE in hour.source
    short = queries.engine_peaks(db_engine, start=start + 30, end=start + 30 + ROLLUP_AFTER_S)  # every step
    assert _peaks(short) == pytest.approx(_peaks_of(steps, start + 30, start + 30 + ROLLUP_AFTER_S))
    assert ROLLUP_NOTE not in short.source
    odd = queries.step_load_over_time(db_engine, bucket_s=90, **window)  # minutes do not nest in 90 s
    assert not any(b.rollup for bs in odd.values() for b in bs)


def test_db_partitions_command(pg_url: str, pg_engine: Engine, sqlite_url: str) -> None:
    runner = CliRunner()
    created = runner.invoke(db_app, ["partitions", "--db-url", pg_url, "--create"])
    assert created.exit_code == 0, created.output
    made = re.search(r"made (\d+) partitions", created.output)
    assert made and int(made[1]) == 5 * len(partitions.PARTITIONED)  # yesterday to 3 days ahead, by default
    assert "steps: 5 day partitions" in created.output and "0 rows in steps_default" in created.output
    listed = runner.invoke(db_app, ["partitions", "--db-url", pg_url])
    assert listed.exit_code == 0 and "made" not in listed.output
    lite = runner.invoke(db_app, ["partitions", "--db-url", sqlite_url])
    assert lite.exit_code == 0 and "SQLite has no partitions" in lite.output
