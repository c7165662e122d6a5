"""The collector's maintenance task: day partitions ahead (PostgreSQL) and the step rollup, at startup and then
every `maintenance_interval_s`, off the request path.

On PostgreSQL one collector at a time does it (a session advisory lock; the others skip the round), so
many stateless collectors on one database do not race on DDL. A round makes the partitions from
yesterday to `partitions_ahead_days` ahead, gives rows that landed in a DEFAULT partition (a day older
than that, within `raw_retention_days`) a partition of their own day, summarizes the BRIN ranges written to
yesterday's and today's partitions since the last round (`partitions.summarize_brin`: an unsummarized range
matches every read of a time window), and reports what is left in a DEFAULT partition in
`kvpilot_collector_partition_default_rows{table}` (and a log line): such rows mean a day had no partition
when they arrived. Every round's outcome is counted in `kvpilot_collector_maintenance_runs{result}`;
a failed round is logged and retried at the next interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import Connection, Engine, text

from collector import latency_rollup, partitions, rollup
from collector.db import translate_errors
from collector.errors import CollectorError
from collector.rollup import RollupResult
from collector.settings import CollectorSettings

log = logging.getLogger("kvpilot.collector.maintenance")

LOCK_KEY = 0x6B76_7069_6D61  # pg_advisory_lock key of the maintenance round ("kvpima")
REHOME_DAYS_PER_ROUND = 7
# Days behind today made ahead of need: yesterday's stays for late pushes. An older day gets its partition
# when a row of it arrives (through the DEFAULT partition), so a long retention does not mean thousands of
# empty partitions.
BEHIND_DAYS = 1
ROLLUP_SPANS_PER_ROUND = 8  # of a day each, one transaction each: a week's backlog in one round
# of `latency_rollup.CHUNK_S` each: a day's backlog a round (the lock ingest's late rows take is released between)
SKETCH_CHUNKS_PER_ROUND = 144


class MaintenanceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter(
            "kvpilot_collector_maintenance_runs", "maintenance rounds by result", ["result"], registry=registry
        )
        self.partitions_created = Counter(
            "kvpilot_collector_partitions_created", "day partitions made by maintenance", registry=registry
        )
        self.default_rows = Gauge(
            "kvpilot_collector_partition_default_rows",
            "rows in a DEFAULT partition (their day had no partition)",
            ["table"],
            registry=registry,
        )
        self.brin_ranges = Counter(
            "kvpilot_collector_brin_ranges_summarized",
            "BRIN page ranges of recent partitions summarized by maintenance (unsummarized ones match every read)",
            registry=registry,
        )
        self.rollup_through = Gauge(
            "kvpilot_collector_rollup_through_ts", "the step rollup is complete before this time", registry=registry
        )
        self.sketch_through = Gauge(
            "kvpilot_collector_latency_sketch_through_ts",
            "the latency sketch holds every finished request before this time (PostgreSQL)",
            registry=registry,
        )
        self.stages_through = Gauge(
            "kvpilot_collector_stage_minutes_through_ts",
            "the per-minute stage sums hold every finished request before this time (PostgreSQL)",
            registry=registry,
        )


@dataclass
class RoundResult:
    skipped: bool = False  # another collector held the lock
    created: list[str] = field(default_factory=list)
    default_rows: dict[str, int] = field(default_factory=dict)
    rollup: rollup.RollupResult | None = None
    brin_ranges: int = 0  # BRIN page ranges summarized (PostgreSQL: `partitions.summarize_brin`)
    latency_sketch: RollupResult | None = None  # the last minutes the latency sketch took (PostgreSQL)
    stage_minutes: RollupResult | None = None  # and the per-minute stage sums


def run_round(engine: Engine, settings: CollectorSettings, *, now: float) -> RoundResult:
    """One maintenance round; raises CollectorError (StorageError) when the database fails."""
    with translate_errors(), engine.connect() as conn:
        if conn.dialect.name != "postgresql":
            return RoundResult(rollup=_roll(conn, settings, now))
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar_one():
            conn.rollback()
            return RoundResult(skipped=True)
        conn.commit()
        try:
            created = partitions.ensure_ahead(
                conn, now=now, behind_days=BEHIND_DAYS, ahead_days=settings.partitions_ahead_days
            )
            since = partitions.day_start(now - settings.raw_retention_days * partitions.DAY_S)
            left = partitions.rehome_default(conn, since=since, max_days=REHOME_DAYS_PER_ROUND)
            summarized = partitions.summarize_brin(conn, now=now)
            rolled = _roll(conn, settings, now)
            sketched, staged = _sketch(conn, settings, now)
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
            conn.commit()
        return RoundResult(
            created=created,
            default_rows=left,
            rollup=rolled,
            brin_ranges=summarized,
            latency_sketch=sketched,
            stage_minutes=staged,
        )


def _roll(conn: Connection, settings: CollectorSettings, now: float) -> rollup.RollupResult | None:
    """Roll steps and allocation records up to a minute before `now`, a day per transaction; the step rollup's
    last span rolled (None: nothing to)."""
    out = None
    for kind in rollup.KINDS:
        last = None
        for _ in range(ROLLUP_SPANS_PER_ROUND):
            with conn.begin():
                done = rollup.roll_up(
                    conn,
                    now=now,
                    first_start=now - settings.raw_retention_days * partitions.DAY_S,
                    lookback_s=settings.rollup_lookback_s,
                    settle_s=rollup.BUCKET_S,
                    max_span_s=partitions.DAY_S,
                    kind=kind,
                )
            if done is None or done.end >= now - 2 * rollup.BUCKET_S:
                last = done or last
                break
            last = done
        if kind is rollup.STEPS_KIND:
            out = last
    return out


def _sketch(
    conn: Connection, settings: CollectorSettings, now: float
) -> tuple[RollupResult | None, RollupResult | None]:
    """Roll request latencies into the sketch and the per-minute stage sums up to `latency_rollup.SETTLE_S`
    before `now`, `CHUNK_S` of each per transaction (each holds the lock ingest's late rows wait on), at most
    `SKETCH_CHUNKS_PER_ROUND` transactions; the last minutes each took (None: none)."""
    first_start = now - settings.raw_retention_days * partitions.DAY_S
    last: list[RollupResult | None] = [None, None]
    for _ in range(SKETCH_CHUNKS_PER_ROUND):
        with conn.begin():
            done = [
                latency_rollup.roll_up(conn, now=now, first_start=first_start),
                latency_rollup.roll_stages(conn, now=now, first_start=first_start),
            ]
        if done == [None, None]:
            break
        last = [d or before for d, before in zip(done, last, strict=True)]
    return last[0], last[1]


class Maintenance:
    """Runs `run_round` at start and every `interval_s` in a thread; outcomes go to metrics and the log."""

    def __init__(
        self,
        engine: Engine,
        settings: CollectorSettings,
        *,
        metrics: MaintenanceMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> RoundResult | None:
        try:
            result = run_round(self.engine, self.settings, now=self.clock())
        except CollectorError as exc:
            self.metrics.runs.labels("failed").inc()
            log.warning("maintenance round failed (retried in %.0f s): %s", self.settings.maintenance_interval_s, exc)
            return None
        self.metrics.runs.labels("skipped" if result.skipped else "ok").inc()
        self._report(result)
        return result

    def _report(self, result: RoundResult) -> None:
        if result.created:
            self.metrics.partitions_created.inc(len(result.created))
            log.info("made %d day partitions: %s", len(result.created), ", ".join(result.created))
        for table, n in result.default_rows.items():
            self.metrics.default_rows.labels(table).set(n)
            if n:
                log.warning("%d rows of %s are in its DEFAULT partition (past retention or not moved yet)", n, table)
        if result.rollup is not None:
            self.metrics.rollup_through.set(result.rollup.end)
        if result.latency_sketch is not None:
            self.metrics.sketch_through.set(result.latency_sketch.end)
        if result.stage_minutes is not None:
            self.metrics.stages_through.set(result.stage_minutes.end)
        if result.brin_ranges:
            self.metrics.brin_ranges.inc(result.brin_ranges)
            log.debug("summarized %d BRIN page ranges", result.brin_ranges)

    def sketch_once(self) -> RollupResult | None:
        """Between rounds, the closed minutes of the latency sketch and the stage sums alone (PostgreSQL): the
        fleet's latency reads sort only the requests after their watermarks, so they follow the clock closer than
        a round. The sketch's minutes (the stage sums' go to their gauge)."""
        try:
            with translate_errors(), self.engine.connect() as conn:
                if conn.dialect.name != "postgresql":
                    return None
                done, staged = _sketch(conn, self.settings, self.clock())
        except CollectorError as exc:
            self.metrics.runs.labels("failed").inc()
            log.warning("latency sketch roll failed (retried in %.0f s): %s", latency_rollup.EVERY_S, exc)
            return None
        if done is not None:
            self.metrics.sketch_through.set(done.end)
        if staged is not None:
            self.metrics.stages_through.set(staged.end)
        return done

    def _loop(self) -> None:
        self.run_once()  # at startup, in this thread: serving does not wait for it
        due = self.clock() + self.settings.maintenance_interval_s
        while not self._stop.wait(max(0.0, min(latency_rollup.EVERY_S, due - self.clock()))):
            if self.clock() >= due:
                self.run_once()
                due = self.clock() + self.settings.maintenance_interval_s
            else:
                self.sketch_once()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvpilot-maintenance", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
