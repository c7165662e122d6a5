"""The per-minute step, allocation and sample rollups (`step_rollups`, `alloc_rollups`, `sample_rollups`): what
history views read instead of every raw row of a long range.

Steps: one row per (instance, run, minute) of non-warm-up steps: how many, their summed duration, and the
highest KV usage, batch size and queue depth among them. A maximum of maxima is the maximum, so peaks read
from the rollup equal the peaks over every step (`collector.queries.step_rollup`). Allocation records: one
row per (instance, run, minute, op, tier): how many, their blocks and bytes, exact sums for the KV page's
operations chart and the trace's count (`collector.queries.engine_stats`). Engine samples: one row per
(instance, run, minute): how many, and per KV gauge its sum and how many samples had it, exact means for the
KV page's usage chart, and which engines sampled for the Overview. A rollup is a `Kind`; what follows holds for
each (their watermarks are apart).

Two writers keep it, and they agree:
- ingest (`add_steps`, in the batch's own transaction): each batch's steps are added to their minutes (counts
  and sums added, maxima raised), so the rollup is current to the last batch committed and a fleet's Overview
  never reads millions of raw steps. A batch is stored once (its idempotency key), so it is added once.
- the collector's maintenance (`roll_up`): before there is a watermark it computes whole minutes from the raw
  steps (rows older than this writer), a day per call, up to `settle_s` before now. After that ingest keeps
  every minute, so a round only moves the watermark on, reading no raw step: recomputing what ingest had just
  written (the last 15 minutes every minute, as it first did) re-read a 1,000-engine fleet's 50 million steps a
  minute, a GROUP BY that took the database's CPU from the ingest. `lookback_s` > 0 recomputes that many seconds
  before the watermark as well (delete those buckets, insert them again: idempotent), to repair rows written
  around ingest (a bench's raw COPY, a restore). Under READ COMMITTED a batch committing during a recompute is
  counted once either way: before the recompute's DELETE it is in the raw rows the INSERT reads; after it, its
  own upsert adds to the recomputed row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Float, Insert, Select, Table, cast, delete, func, insert, literal, select

from collector.bulk import many_rows_insert, many_rows_params
from collector.queries import bucket_expr
from collector.queries.step_rollup import ALLOC_WATERMARK as ALLOCS
from collector.queries.step_rollup import ROLLUP_BUCKET_S as BUCKET_S
from collector.queries.step_rollup import SAMPLE_GAUGES
from collector.queries.step_rollup import SAMPLE_WATERMARK as SAMPLES
from collector.queries.step_rollup import WATERMARK as STEPS
from collector.schema import AllocRollup, AllocRow, RollupWatermark, SampleRollup, SampleRow, StepRollup, StepRow


@dataclass(frozen=True)
class RollupResult:
    start: float
    end: float  # the new watermark
    buckets: int


def watermark(conn: Connection, name: str = STEPS) -> float | None:
    w = RollupWatermark.__table__
    return conn.execute(select(w.c.through_ts).where(w.c.name == name)).scalar_one_or_none()


@dataclass(frozen=True)
class Kind:
    """One rollup: its watermark's name, its table, and its rows of [start, end) computed from the raw rows
    (in `columns`' order)."""

    name: str
    table: Table
    columns: tuple[str, ...]
    source: Callable[[float, float, str], Select]


def _step_source(start: float, end: float, dialect: str) -> Select:
    st = StepRow.__table__.c
    bucket = bucket_expr(st.ts, BUCKET_S, dialect).label("bucket")
    return (
        select(
            st.instance,
            st.run_id,
            bucket,
            func.count(),
            func.sum(st.duration_s),
            func.max(cast(st.kv_blocks_used, Float) / func.nullif(st.kv_blocks_total, 0)),
            func.max(st.num_seqs),
            func.max(st.queue_depth),
        )
        .where(st.ts >= start, st.ts < end, st.warmup.is_(False))
        .group_by(st.instance, st.run_id, bucket)
    )


def _alloc_source(start: float, end: float, dialect: str) -> Select:
    a = AllocRow.__table__.c
    bucket = bucket_expr(a.ts, BUCKET_S, dialect).label("bucket")
    return (
        select(a.instance, a.run_id, bucket, a.op, a.tier, func.count(), func.sum(a.blocks), func.sum(a.bytes))
        .where(a.ts >= start, a.ts < end)
        .group_by(a.instance, a.run_id, bucket, a.op, a.tier)
    )


def _sample_source(start: float, end: float, dialect: str) -> Select:
    sm = SampleRow.__table__.c
    bucket = bucket_expr(sm.ts, BUCKET_S, dialect).label("bucket")
    gauges = [f(sm[g]) for g in SAMPLE_GAUGES for f in (lambda c: func.coalesce(func.sum(c), 0.0), func.count)]
    return (
        select(sm.instance, sm.run_id, bucket, func.count(), *gauges)
        .where(sm.ts >= start, sm.ts < end)
        .group_by(sm.instance, sm.run_id, bucket)
    )


_STEP_COLUMNS = ("instance", "run_id", "bucket_ts", "steps", "duration_sum", "kv_usage_max", "running_max")
STEPS_KIND = Kind(STEPS, StepRollup.__table__, (*_STEP_COLUMNS, "waiting_max"), _step_source)
ALLOCS_KIND = Kind(
    ALLOCS,
    AllocRollup.__table__,
    ("instance", "run_id", "bucket_ts", "op", "tier", "events", "blocks", "bytes"),
    _alloc_source,
)
# a sample rollup row's columns after its key: how many samples, then a sum and a count per gauge
_SAMPLE_VALUES = ("samples", *(f"{g}_{part}" for g in SAMPLE_GAUGES for part in ("sum", "n")))
SAMPLES_KIND = Kind(
    SAMPLES, SampleRollup.__table__, ("instance", "run_id", "bucket_ts", *_SAMPLE_VALUES), _sample_source
)
KINDS = (STEPS_KIND, ALLOCS_KIND, SAMPLES_KIND)


def roll_up(
    conn: Connection,
    *,
    now: float,
    first_start: float,
    lookback_s: float,
    settle_s: float,
    max_span_s: float,
    kind: Kind = STEPS_KIND,
) -> RollupResult | None:
    """Compute `kind`'s buckets from `first_start` while there is no watermark, else recompute `lookback_s`
    before it (none when 0: ingest keeps them), up to `settle_s` before `now`, at most `max_span_s` of them, and
    move the watermark there; None when there is nothing to do yet."""
    through = watermark(conn, kind.name)
    start = floor_minute(first_start if through is None else through - lookback_s)
    end = min(floor_minute(now - settle_s), start + floor_minute(max_span_s))
    if end <= start:
        return None
    if through is not None and lookback_s <= 0:
        set_watermark(conn, kind.name, end, exists=True)  # ingest added every row of these minutes as it stored them
        return RollupResult(start, end, 0)
    table = kind.table
    conn.execute(delete(table).where(table.c.bucket_ts >= start, table.c.bucket_ts < end))
    src = kind.source(start, end, conn.dialect.name)
    written = insert_from_select(conn, insert(table).from_select([table.c[c] for c in kind.columns], src))
    set_watermark(conn, kind.name, end, exists=through is not None)
    return RollupResult(start, end, written)


def set_watermark(conn: Connection, name: str, through: float, *, exists: bool) -> None:
    w = RollupWatermark.__table__
    if exists:
        conn.execute(w.update().where(w.c.name == name).values(through_ts=through))
    else:
        conn.execute(insert(w).values(name=name, through_ts=literal(through, Float)))


def insert_from_select(conn: Connection, stmt: Insert) -> int:
    """Run an INSERT ... SELECT; the rows it wrote (SQLAlchemy reports -1 for one on PostgreSQL unless asked to
    keep the driver's count)."""
    return max(conn.execute(stmt.execution_options(preserve_rowcount=True)).rowcount or 0, 0)


def floor_minute(ts: float) -> float:
    """The start of the rollup minute `ts` falls in."""
    return math.floor(ts / BUCKET_S) * BUCKET_S


def add_steps(conn: Connection, rows: Sequence[tuple[Any, ...]], columns: Sequence[str]) -> int:
    """Add a batch's step rows (tuples in `columns`' order) to their minutes' rollup rows, in the caller's
    transaction; how many rollup rows were touched. Warm-up steps are left out, as `roll_up` leaves them."""
    at = {name: k for k, name in enumerate(columns)}
    ins, run, ts, dur = at["instance"], at["run_id"], at["ts"], at["duration_s"]
    used, total, seqs, queue, warm = (
        at["kv_blocks_used"], at["kv_blocks_total"], at["num_seqs"], at["queue_depth"], at["warmup"]
    )  # fmt: skip
    buckets: dict[tuple[str, str, float], list[Any]] = {}
    for row in rows:
        if row[warm]:
            continue
        key = (row[ins], row[run], floor_minute(row[ts]))
        kv = row[used] / row[total] if row[total] else None
        b = buckets.get(key)
        if b is None:
            buckets[key] = [1, row[dur], kv, row[seqs], row[queue]]
            continue
        b[0] += 1
        b[1] += row[dur]
        if kv is not None and (b[2] is None or kv > b[2]):
            b[2] = kv
        b[3] = max(b[3], row[seqs])
        b[4] = max(b[4], row[queue])
    if not buckets:
        return 0
    values = [
        {"instance": i, "run_id": r, "bucket_ts": t, "steps": n, "duration_sum": d, "kv_usage_max": kv,
         "running_max": rm, "waiting_max": wm}
        for (i, r, t), (n, d, kv, rm, wm) in sorted(buckets.items())  # one lock order for concurrent batches
    ]  # fmt: skip
    conn.execute(_add_statement(conn.dialect.name), many_rows_params(conn, values))
    return len(values)


def add_allocs(conn: Connection, rows: Sequence[tuple[Any, ...]], columns: Sequence[str]) -> int:
    """Add a batch's allocation rows (tuples in `columns`' order) to their minutes' rollup rows, in the
    caller's transaction; how many rollup rows were touched."""
    at = {name: k for k, name in enumerate(columns)}
    ins, run, ts, op, tier, blocks, size = (
        at["instance"], at["run_id"], at["ts"], at["op"], at["tier"], at["blocks"], at["bytes"]
    )  # fmt: skip
    buckets: dict[tuple[str, str, float, str, str], list[int]] = {}
    for row in rows:
        key = (row[ins], row[run], floor_minute(row[ts]), row[op], row[tier])
        b = buckets.get(key)
        if b is None:
            buckets[key] = [1, row[blocks], row[size]]
        else:
            b[0] += 1
            b[1] += row[blocks]
            b[2] += row[size]
    values = [
        {"instance": i, "run_id": r, "bucket_ts": t, "op": o, "tier": tr, "events": n, "blocks": bl, "bytes": by}
        for (i, r, t, o, tr), (n, bl, by) in sorted(buckets.items())  # one lock order for concurrent batches
    ]
    if values:
        conn.execute(_add_allocs_statement(conn.dialect.name), many_rows_params(conn, values))
    return len(values)


def add_samples(conn: Connection, rows: Sequence[tuple[Any, ...]], columns: Sequence[str]) -> int:
    """Add a batch's sample rows (tuples in `columns`' order) to their minutes' rollup rows, in the caller's
    transaction; how many rollup rows were touched."""
    at = {name: k for k, name in enumerate(columns)}
    ins, run, ts = at["instance"], at["run_id"], at["ts"]
    gauges = [at[g] for g in SAMPLE_GAUGES]
    buckets: dict[tuple[str, str, float], list[Any]] = {}
    for row in rows:
        key = (row[ins], row[run], floor_minute(row[ts]))
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = [0] + [0.0, 0] * len(gauges)
        b[0] += 1
        for k, g in enumerate(gauges):
            value = row[g]
            if value is not None:
                b[1 + 2 * k] += value
                b[2 + 2 * k] += 1
    values = [
        {"instance": i, "run_id": r, "bucket_ts": t, **dict(zip(_SAMPLE_VALUES, b, strict=True))}
        for (i, r, t), b in sorted(buckets.items())  # one lock order for concurrent batches
    ]
    if values:
        conn.execute(_add_samples_statement(conn.dialect.name), many_rows_params(conn, values))
    return len(values)


def summing_upsert(dialect: str, table: Table, keys: tuple[str, ...], sums: tuple[str, ...]) -> Any:
    """An INSERT of many rows (`collector.bulk.many_rows_insert`) ... ON CONFLICT on `keys`: each column of
    `sums` added to the stored row's (counts and sums of a minute, from a batch or late rows)."""
    stmt = many_rows_insert(dialect, table, (*keys, *sums))
    return stmt.on_conflict_do_update(index_elements=list(keys), set_={c: table.c[c] + stmt.excluded[c] for c in sums})


@functools.cache
def _add_samples_statement(dialect: str) -> Any:
    return summing_upsert(dialect, SampleRollup.__table__, ("instance", "run_id", "bucket_ts"), _SAMPLE_VALUES)


@functools.cache
def _add_allocs_statement(dialect: str) -> Any:
    keys = ("instance", "run_id", "bucket_ts", "op", "tier")
    return summing_upsert(dialect, AllocRollup.__table__, keys, ("events", "blocks", "bytes"))


# the columns of a batch's step rollup rows (`add_steps`), in the order its statement takes them
_ADD_STEP_COLUMNS = (*_STEP_COLUMNS, "waiting_max")


@functools.cache  # built once per dialect: it runs on every batch with steps
def _add_statement(dialect: str) -> Any:
    """INSERT ... ON CONFLICT: counts and sums added, maxima raised (a NULL KV usage is no maximum)."""
    table = StepRollup.__table__
    stmt = many_rows_insert(dialect, table, _ADD_STEP_COLUMNS)
    greatest = func.max if dialect == "sqlite" else func.greatest  # SQLite's two-argument max() is scalar
    old, new = table.c, stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=["instance", "run_id", "bucket_ts"],
        set_={
            "steps": old.steps + new.steps,
            "duration_sum": old.duration_sum + new.duration_sum,
            "kv_usage_max": greatest(
                func.coalesce(old.kv_usage_max, new.kv_usage_max), func.coalesce(new.kv_usage_max, old.kv_usage_max)
            ),
            "running_max": greatest(old.running_max, new.running_max),
            "waiting_max": greatest(old.waiting_max, new.waiting_max),
        },
    )
