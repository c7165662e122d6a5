"""Engine-side figures: KV memory and throughput over time, the KV allocation trace, the latest gauges."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.sql import ColumnElement

from collector.queries._base import Db, Points, _bound, _dialect, _f, bucket_expr, scope
from collector.queries.step_rollup import ROLLUP_AFTER_S, ROLLUP_BUCKET_S, SAMPLE_GAUGES
from collector.schema import AllocRollup, AllocRow, SampleRollup, SampleRow, StepRow
from collector.series import SAMPLE_COLUMNS

# --- engine steps and KV over time -----------------------------------------------------------------


@dataclass(frozen=True)
class KvBucket:
    ts: float
    kv_usage: float | None
    cold_usage: float | None
    fragmentation: float | None
    internal_waste: float | None
    samples: int


def kv_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> dict[str, list[KvBucket]]:
    """instance -> bucketed averages of KV usage, cold usage, fragmentation and internal waste.

    A window longer than `ROLLUP_AFTER_S` bucketed by whole minutes reads the per-minute sample rollup
    (`collector.rollup`: per gauge a sum and a count, so its means are the means of every sample), its first
    and last minutes whole, as the step rollup's windows are: an hour of a 1,000-engine fleet is 3.6 million
    samples and 60,000 rollup rows."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    out: dict[str, list[KvBucket]] = defaultdict(list)
    with _bound(db) as conn:
        if end - start > ROLLUP_AFTER_S and not bucket_s % ROLLUP_BUCKET_S:
            r = SampleRollup.__table__.c
            b = bucket_expr(r.bucket_ts, bucket_s, _dialect(conn)).label("bucket")
            sums = [func.sum(r[f"{g}_{part}"]) for g in SAMPLE_GAUGES for part in ("sum", "n")]
            conds = rollup_filter(SampleRollup.__table__, start, end, instances, run_id)
            stmt = (
                select(r.instance, b, func.sum(r.samples), *sums)
                .where(*conds)
                .group_by(r.instance, b)
                .order_by(r.instance, b)
            )
            for inst, bucket, n, *pairs in conn.execute(stmt):
                totals, counts = pairs[::2], pairs[1::2]
                kv, cold, frag, waste = (float(t) / int(c) if c else None for t, c in zip(totals, counts, strict=True))
                out[inst].append(KvBucket(float(bucket), kv, cold, frag, waste, int(n)))
            return dict(out)
        s = SampleRow.__table__.c
        b = bucket_expr(s.ts, bucket_s, _dialect(conn)).label("bucket")
        conds = sample_filter(start, end, instances, run_id)
        stmt = (
            select(
                s.instance,
                b,
                func.avg(s.kv_usage),
                func.avg(s.cold_usage),
                func.avg(s.fragmentation),
                func.avg(s.internal_waste),
                func.count(),
            )
            .where(*conds)
            .group_by(s.instance, b)
            .order_by(s.instance, b)
        )
        for inst, bucket, kv, cold, frag, waste, n in conn.execute(stmt):
            out[inst].append(KvBucket(float(bucket), _f(kv), _f(cold), _f(frag), _f(waste), int(n)))
    return dict(out)


def sample_filter(start: float, end: float, instances: Sequence[str] | None, run_id: str | None) -> list[ColumnElement]:
    """The raw samples of a window, with its filters."""
    return scope(SampleRow.__table__, start, end, instances, run_id)


def rollup_filter(
    table: Table, start: float, end: float, instances: Sequence[str] | None, run_id: str | None
) -> list[ColumnElement]:
    """A per-minute rollup's (`table`: instance, run_id, bucket_ts) minutes a window touches (the first whole),
    with the window's filters."""
    lo = math.floor(start / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S
    return scope(table, lo, end, instances, run_id, ts="bucket_ts")


@dataclass(frozen=True)
class ThroughputBucket:
    ts: float
    steps: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    mean_step_s: float
    busy_fraction: float
    kv_blocks_used: float


def throughput_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> dict[str, list[ThroughputBucket]]:
    """instance -> per-bucket engine throughput from step events (tokens/s, step time, busy fraction).

    A step counts in the bucket where it ran: by the middle of its run (its end `ts` minus half its
    duration), so a bucket's tokens/s is what the steps that ran in it produced over its width.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    st = StepRow.__table__.c
    with _bound(db) as conn:
        b = bucket_expr(st.ts - st.duration_s / 2, bucket_s, _dialect(conn)).label("bucket")
        conds = [*scope(StepRow.__table__, start, end, instances, run_id), st.warmup.is_(False)]
        stmt = (
            select(
                st.instance,
                b,
                func.count(),
                func.sum(st.prefill_tokens),
                func.sum(st.decode_tokens),
                func.avg(st.duration_s),
                func.sum(st.busy_s),
                func.avg(st.kv_blocks_used),
            )
            .where(*conds)
            .group_by(st.instance, b)
            .order_by(st.instance, b)
        )
        out: dict[str, list[ThroughputBucket]] = defaultdict(list)
        for inst, bucket, n, pf, dc, mean_step, busy, blocks in conn.execute(stmt):
            out[inst].append(
                ThroughputBucket(
                    ts=float(bucket),
                    steps=int(n),
                    prefill_tokens_per_s=float(pf or 0) / bucket_s,
                    decode_tokens_per_s=float(dc or 0) / bucket_s,
                    mean_step_s=float(mean_step or 0.0),
                    busy_fraction=min(1.0, float(busy or 0.0) / bucket_s),
                    kv_blocks_used=float(blocks or 0.0),
                )
            )
    return dict(out)


@dataclass(frozen=True)
class AllocOpBucket:
    ts: float
    op: str
    tier: str
    events: int
    blocks: int
    bytes: int


def alloc_ops_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> list[AllocOpBucket]:
    """KV allocation trace downsampled: events, blocks and bytes per (bucket, op, tier). A window longer than
    `ROLLUP_AFTER_S` bucketed by whole minutes reads the per-minute allocation rollup (`collector.rollup`: exact
    sums, no raw record), its first and last minutes whole, as the step rollup's windows are."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    with _bound(db) as conn:
        if end - start > ROLLUP_AFTER_S and not bucket_s % ROLLUP_BUCKET_S:
            r = AllocRollup.__table__.c
            bucket = bucket_expr(r.bucket_ts, bucket_s, _dialect(conn)).label("b")
            cols: tuple[Any, ...] = (r.op, r.tier, func.sum(r.events), func.sum(r.blocks), func.sum(r.bytes))
            conds = rollup_filter(AllocRollup.__table__, start, end, instances, run_id)
        else:
            a = AllocRow.__table__.c
            bucket = bucket_expr(a.ts, bucket_s, _dialect(conn)).label("b")
            cols = (a.op, a.tier, func.count(), func.sum(a.blocks), func.sum(a.bytes))
            conds = _alloc_filter(start, end, instances, run_id)
        stmt = select(bucket, *cols).where(*conds).group_by(bucket, *cols[:2]).order_by(bucket, *cols[:2])
        rows = conn.execute(stmt).all()
    return [AllocOpBucket(float(b), op, tier, int(n), int(blk or 0), int(by or 0)) for b, op, tier, n, blk, by in rows]


def _alloc_filter(
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    ops: Sequence[str] | None = None,
) -> list[ColumnElement]:
    conds = scope(AllocRow.__table__, start, end, instances, run_id)
    if ops is not None:
        conds.append(AllocRow.__table__.c.op.in_(ops))
    return conds


@dataclass(frozen=True)
class AllocTrace:
    total: int
    events: list[dict[str, Any]]


def alloc_trace(
    db: Db,
    *,
    start: float,
    end: float,
    limit: int = 2000,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    ops: Sequence[str] | None = None,
) -> AllocTrace:
    """The newest `limit` allocation events of the window in time order, and how many the window holds. The
    count of a window longer than `ROLLUP_AFTER_S` adds the allocation rollup's minutes inside it to the raw
    records of the partial minutes at its ends: exact, without counting every record of an hour.

    The events are read from the window's end backwards (`_newest_allocs`): a fleet's newest 2,000 records are
    its last second, and ordering the whole window's records (an hour of a 1,000-engine fleet's) to keep them
    read every one of them."""
    limit = max(0, int(limit))
    with _bound(db) as conn:
        total, tail = _alloc_count(conn, start, end, instances, run_id, ops)
        events = _newest_allocs(conn, start, end, limit, total, tail, instances, run_id, ops) if limit else []
    events.reverse()
    return AllocTrace(total=total, events=events)


TRACE_SLICE_MARGIN = 4.0  # the first slice read: this many times the span the end's rate fills `limit` in
TRACE_SLICE_GROWTH = 8.0  # each later slice this many times as long, until it holds `limit` or is the window
TRACE_TAIL_MIN_S = 5.0  # a partial last minute shorter than this says little of the rate: the window's mean does


@dataclass(frozen=True)
class _Tail:
    """The window's last partial minute, `[minute, end)`: its records and its length (none read: the window's
    mean rate serves)."""

    records: int = 0
    span_s: float = 0.0


def _newest_allocs(
    conn: Any,
    start: float,
    end: float,
    limit: int,
    total: int,
    tail: _Tail,
    instances: Sequence[str] | None,
    run_id: str | None,
    ops: Sequence[str] | None,
) -> list[dict[str, Any]]:
    """The window's newest `limit` records, newest first: read from the last slice of the window, `[end - d,
    end)`, whose length `d` the rate at the window's end suggests (its last partial minute's records, counted
    for the window's total; else the window's mean), and from longer slices until one holds `limit` records (or
    is the whole window). Exact: a slice at the window's end that holds `limit` records holds the newest
    `limit` (a wrong rate only costs a longer slice or another statement). The mean alone misleads where a
    fleet started late in the window (a run of a few minutes in an hour: the first slice read was 20 times
    longer than the newest 2,000 needed)."""
    t = AllocRow.__table__
    span = end - start
    if tail.span_s >= TRACE_TAIL_MIN_S and tail.records:
        rate = tail.records / tail.span_s
    else:
        rate = total / span if span > 0 else 0.0
    d = span if total <= limit or rate <= 0 else min(span, max(1.0, TRACE_SLICE_MARGIN * limit / rate))
    while True:
        lo = max(start, end - d)
        conds = _alloc_filter(lo, end, instances, run_id, ops)
        stmt = select(t).where(*conds).order_by(t.c.ts.desc(), t.c.id.desc()).limit(limit)
        events = [dict(row._mapping) for row in conn.execute(stmt)]
        if len(events) >= limit or lo <= start:
            return events
        d *= TRACE_SLICE_GROWTH


def _alloc_count(
    conn: Any, start: float, end: float, instances: Sequence[str] | None, run_id: str | None, ops: Sequence[str] | None
) -> tuple[int, _Tail]:
    """How many allocation records the window holds (`alloc_trace`), and its last partial minute's."""

    def raw(lo: float, hi: float) -> Any:
        return select(func.count()).where(*_alloc_filter(lo, hi, instances, run_id, ops)).scalar_subquery()

    first = math.ceil(start / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S  # the whole minutes inside the window
    last = math.floor(end / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S
    if end - start <= ROLLUP_AFTER_S or last <= first:
        return int(conn.execute(select(raw(start, end))).scalar_one()), _Tail()
    r = AllocRollup.__table__.c
    conds = scope(AllocRollup.__table__, first, last, instances, run_id, ts="bucket_ts")
    if ops is not None:
        conds.append(r.op.in_(ops))
    rolled = select(func.coalesce(func.sum(r.events), 0)).where(*conds).scalar_subquery()
    head, middle, tail = conn.execute(select(raw(start, first), rolled, raw(last, end))).one()
    return int(head) + int(middle) + int(tail), _Tail(int(tail), end - last)


def latest_samples(
    db: Db,
    *,
    end: float,
    start: float | None = None,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
) -> dict[str, dict[str, Any]]:
    """instance -> its newest sample row with `start <= ts < end` (all sample columns, NULL gauges as None)."""
    s = SampleRow.__table__
    conds: list[ColumnElement] = [s.c.ts < end]
    if start is not None:
        conds.append(s.c.ts >= start)
    if instances is not None:
        conds.append(s.c.instance.in_(instances))
    if run_id is not None:
        conds.append(s.c.run_id == run_id)
    ranked = (
        select(
            s,
            func.row_number().over(partition_by=s.c.instance, order_by=(s.c.ts.desc(), s.c.id.desc())).label("rn"),
        )
        .where(*conds)
        .subquery()
    )
    stmt = select(*[ranked.c[c.name] for c in s.columns]).where(ranked.c.rn == 1).order_by(ranked.c.instance)
    with _bound(db) as conn:
        return {row.instance: dict(row._mapping) for row in conn.execute(stmt)}


def run_gauges_over_time(
    db: Db,
    *,
    names: Sequence[str],
    start: float,
    end: float,
    bucket_s: float,
    run_id: str,
    instances: Sequence[str] | None = None,
) -> dict[str, Points]:
    """name -> instance -> [(bucket_start, average)] of engine-sampled gauges of one run, downsampled in SQL.

    Only the samples table carries a run id, so scraped series (which have none) are not part of a run.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    unknown = [n for n in names if n not in SAMPLE_COLUMNS]
    if unknown:
        raise ValueError(f"not engine-sampled gauges: {unknown}; sampled: {', '.join(sorted(SAMPLE_COLUMNS))}")
    s = SampleRow.__table__.c
    conds = scope(SampleRow.__table__, start, end, instances, run_id)
    out: dict[str, Points] = {}
    with _bound(db) as conn:
        b = bucket_expr(s.ts, bucket_s, _dialect(conn)).label("bucket")
        averages = [func.avg(s[SAMPLE_COLUMNS[n]]) for n in names]
        stmt = select(s.instance, b, *averages).where(*conds).group_by(s.instance, b).order_by(s.instance, b)
        for row in conn.execute(stmt):
            for name, value in zip(names, row[2:], strict=True):
                if value is not None:
                    out.setdefault(name, {}).setdefault(row[0], []).append((float(row[1]), float(value)))
    return out
