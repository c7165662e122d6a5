"""The per-minute latency sketch (`latency_sketches`, read by `collector.queries.latency_sketch`) and stage sums
(`request_stage_minutes`, read by the stage breakdown in `collector.queries.request_rates`), PostgreSQL.

Each has its own watermark (`WATERMARK`, `STAGES`: a database that had the sketch first rolls the stage sums
from its oldest raw requests); what follows holds for both. Two writers keep each, and a lock keeps them from
counting a request twice or not at all:
- the collector's maintenance (`roll_up`, `roll_stages`) adds whole minutes from the raw rows, up to
  `SETTLE_S` before now, `CHUNK_S` per transaction, and moves the watermark past them. It holds `LOCK`
  exclusively (a transaction advisory lock) from before it reads the watermark to its commit.
- ingest (`add_late`) adds the rows of a batch that are older than the watermark (a spooled push, a late
  relay), which the maintenance has rolled past. It takes `LOCK` shared after writing the batch's rows and
  reads the watermark after that, in its own statement.
A batch that commits before a roll takes the lock is in the raw rows that roll reads, and it read the old
watermark, so it added nothing; one that takes the shared lock after a roll committed reads the new
watermark and adds its rows before it. Ingest batches share the lock, so they never wait on each other; they
wait only while a roll computes (a minute of a 1,000-engine fleet's requests: tenths of a second).

Unlike the step rollup, a fleet-wide row is written by every collector, so ingest does not add every batch
(concurrent transactions would queue on the same rows); only late rows, which are few. Rolling reads each
closed minute once. On SQLite nothing is rolled: its reads stay on the raw rows (one server's, small).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, Float, cast, func, insert, literal, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import ColumnElement

from collector.bulk import many_rows_params
from collector.queries.latency_sketch import METRICS, WATERMARK, bin_expr, bin_of
from collector.queries.request_rates import STAGE_COLUMNS, STAGES, stage_sums
from collector.queries.request_stats import metric_column
from collector.queries.step_rollup import ROLLUP_BUCKET_S as BUCKET_S
from collector.rollup import (
    RollupResult,
    floor_minute,
    insert_from_select,
    set_watermark,
    summing_upsert,
    watermark,
)
from collector.schema import LatencySketch, RequestRow, RequestStageMinute, RollupWatermark, Run

LOCK = 0x6B76_706C_6174  # the transaction advisory lock between the roll and ingest's late rows ("kvplat")
SETTLE_S = 15.0  # a minute is rolled this long after it ends: most of its requests are stored by then
EVERY_S = 15.0  # how often the collector's maintenance looks for a closed minute (`collector.maintenance`)
CHUNK_S = 600.0  # minutes per roll transaction: the lock is held while it computes


def roll_up(conn: Connection, *, now: float, first_start: float) -> RollupResult | None:
    """One transaction's roll of the sketch (the caller's): lock, then the minutes from its watermark (when there
    is none, from `first_start` or the first event stored, whichever is later) up to `SETTLE_S` before `now`, at
    most `CHUNK_S` of them; None when there is nothing to roll (or not PostgreSQL)."""
    return _roll(conn, WATERMARK, _write_sketch, now=now, first_start=first_start)


def roll_stages(conn: Connection, *, now: float, first_start: float) -> RollupResult | None:
    """As `roll_up`, for the per-minute stage sums (`request_stage_minutes`) under their own watermark (a
    database that had the sketch before them rolls them from its oldest raw requests)."""
    return _roll(conn, STAGES, _write_stages, now=now, first_start=first_start)


def _roll(
    conn: Connection, name: str, write: Callable[[Connection, float, float], int], *, now: float, first_start: float
) -> RollupResult | None:
    if conn.dialect.name != "postgresql":
        return None
    seen = watermark(conn, name)
    if seen is not None and floor_minute(now - SETTLE_S) <= seen:  # nothing closed since: no lock taken
        return None
    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": LOCK})
    through = watermark(conn, name)  # again, under the lock: another collector may have rolled
    if through is None:  # from the first event stored (the runs' spans; no scan of the raw rows), if later
        first_seen = conn.execute(select(func.min(Run.__table__.c.first_seen_ts))).scalar_one_or_none()
        if first_seen is None:  # nothing stored yet
            return None
        first_start = max(first_start, float(first_seen))
    start = floor_minute(first_start if through is None else through)
    end = min(floor_minute(now - SETTLE_S), start + CHUNK_S)
    if end <= start:
        return None
    written = write(conn, start, end)
    set_watermark(conn, name, end, exists=through is not None)
    return RollupResult(start, end, written)


def _rolled(start: float, end: float) -> tuple[ColumnElement, list[ColumnElement]]:
    """The minute of a raw request, and the requests a roll of [start, end) counts."""
    r = RequestRow.__table__.c
    bucket = cast(func.floor(r.ts / literal(BUCKET_S)) * literal(BUCKET_S), Float)
    return bucket, [r.ts >= start, r.ts < end, r.status == "finished", r.warmup.is_(False)]


def _write_sketch(conn: Connection, start: float, end: float) -> int:
    s = LatencySketch.__table__
    bucket, conds = _rolled(start, end)
    written = 0
    # one statement a stage: measured on 10 minutes of a fleet's requests, 0.42 s a minute rolled; one scan
    # unpivoting each row into its stages (JOIN LATERAL) took 1.24 s (eight times the rows into one aggregate)
    for metric in METRICS:
        value = metric_column(metric)
        binned = bin_expr(value, "postgresql")
        src = (
            select(literal(metric), bucket, binned, func.count(value), func.sum(value), func.max(value))
            .where(*conds, value.is_not(None))
            .group_by(bucket, binned)
        )
        cols = [s.c.metric, s.c.bucket_ts, s.c.bin, s.c.count, s.c.total, s.c.peak]
        written += insert_from_select(conn, insert(s).from_select(cols, src))
    return written


def _write_stages(conn: Connection, start: float, end: float) -> int:
    m = RequestStageMinute.__table__
    bucket, conds = _rolled(start, end)
    src = select(bucket, func.count(), *stage_sums(RequestRow.__table__.c)).where(*conds).group_by(bucket)
    cols = [m.c.bucket_ts, *(m.c[c] for c in STAGE_COLUMNS)]
    return insert_from_select(conn, insert(m).from_select(cols, src))


def add_late(conn: Connection, rows: Sequence[tuple[Any, ...]], columns: Sequence[str]) -> int:
    """Add a batch's request rows older than the sketch's watermark to it, and those older than the stage
    minutes' watermark to them, in the batch's transaction (after its rows are written); how many rows were
    late for either. PostgreSQL only."""
    if conn.dialect.name != "postgresql" or not rows:
        return 0
    conn.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": LOCK})
    w = RollupWatermark.__table__.c  # read in a statement of its own, after the lock is held
    marks: dict[str, float] = {
        n: t for n, t in conn.execute(select(w.name, w.through_ts).where(w.name.in_((WATERMARK, STAGES))))
    }
    if not marks:
        return 0
    at = {name: k for k, name in enumerate(columns)}
    ts, status, warm = at["ts"], at["status"], at["warmup"]
    last = max(marks.values())
    late = [row for row in rows if row[ts] < last and row[status] == "finished" and not row[warm]]
    if WATERMARK in marks:
        _add_to_sketch(conn, [row for row in late if row[ts] < marks[WATERMARK]], at)
    if STAGES in marks:
        _add_to_stages(conn, [row for row in late if row[ts] < marks[STAGES]], at)
    return len(late)


def _add_to_sketch(conn: Connection, late: Sequence[tuple[Any, ...]], at: dict[str, int]) -> None:
    if not late:
        return
    bins: dict[tuple[str, float, int], list[float]] = {}
    for row in late:
        minute = floor_minute(row[at["ts"]])
        for metric, value in stage_values(row, at):
            if value is None:
                continue
            key = (metric, minute, bin_of(value))
            b = bins.get(key)
            if b is None:
                bins[key] = [1, value, value]
            else:
                b[0] += 1
                b[1] += value
                b[2] = max(b[2], value)
    values = [
        {"metric": m, "bucket_ts": t, "bin": i, "count": n, "total": total, "peak": peak}
        for (m, t, i), (n, total, peak) in sorted(bins.items())  # one lock order for concurrent batches
    ]
    conn.execute(_add_statement(), values)


def _add_to_stages(conn: Connection, late: Sequence[tuple[Any, ...]], at: dict[str, int]) -> None:
    """The late rows' stage sums added to their minutes, as `stage_sums` computes them in SQL."""
    if not late:
        return
    queue, prefill, decode, swap, e2e, frontend, swaps, preemptions = (
        at["queue_s"], at["prefill_s"], at["decode_s"], at["swap_s"], at["e2e_s"], at["frontend_s"], at["swaps"],
        at["preemptions"],
    )  # fmt: skip
    minutes: dict[float, list[float]] = {}
    for row in late:
        sums = minutes.setdefault(floor_minute(row[at["ts"]]), [0] * len(STAGE_COLUMNS))
        d, s = row[decode], row[swap]
        for k, value in enumerate(
            (1, row[queue], row[prefill], d, d - s if d > s else 0.0, s, row[e2e], row[frontend] or 0.0, row[swaps],
             row[preemptions])
        ):  # fmt: skip
            sums[k] += value
    values = [{"bucket_ts": t, **dict(zip(STAGE_COLUMNS, sums, strict=True))} for t, sums in sorted(minutes.items())]
    conn.execute(_add_stages_statement(), many_rows_params(conn, values))


@functools.cache
def _add_stages_statement() -> Any:
    return summing_upsert("postgresql", RequestStageMinute.__table__, ("bucket_ts",), STAGE_COLUMNS)


def stage_values(row: tuple[Any, ...], at: dict[str, int]) -> list[tuple[str, float | None]]:
    """Each sketched stage's value of one request row, as `collector.queries.request_stats.metric_column`
    computes it in SQL."""
    frontend = row[at["frontend_s"]]
    ttft, decode, out = row[at["ttft_s"]], row[at["decode_s"]], row[at["output_tokens"]]
    before = frontend or 0.0
    return [
        ("ttft", None if ttft is None else ttft + before),
        ("e2e", row[at["e2e_s"]] + before),
        ("frontend", frontend),
        ("queue", row[at["queue_s"]]),
        ("prefill", row[at["prefill_s"]]),
        ("decode", decode),
        ("swap", row[at["swap_s"]]),
        ("tpot", decode / (out - 1) if out > 1 else None),
    ]


@functools.cache
def _add_statement() -> Any:
    """INSERT ... ON CONFLICT: counts and sums added, the maximum raised."""
    table = LatencySketch.__table__
    stmt = postgresql.insert(table)
    old, new = table.c, stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=["metric", "bucket_ts", "bin"],
        set_={
            "count": old.count + new.count,
            "total": old.total + new.total,
            "peak": func.greatest(old.peak, new.peak),
        },
    )
