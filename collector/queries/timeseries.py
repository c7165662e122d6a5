"""Canonical series over time from whichever table holds them: samples, steps, scrapes, downsampled history."""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, Select, cast, func, select, union_all

from collector.queries._base import Db, Points, _bound, _dialect, bucket_expr
from collector.schema import (
    AllocRow,
    DownsampledPoint,
    RequestRow,
    SampleRow,
    SeriesPoint,
    StepRow,
)
from collector.series import CANONICAL, SAMPLE_COLUMNS, STEP_COLUMNS, list_series_names

# --- canonical series ------------------------------------------------------------------------------


def is_ratio_series(name: str) -> bool:
    canonical = CANONICAL.get(name)
    return canonical is not None and canonical.unit in ("ratio", "bool", "seconds", "celsius")


def _sources(
    name: str, start: float, end: float, instances: Sequence[str] | None, labels: dict[str, str] | None
) -> list[Select]:
    """One SELECT (instance, ts, value) per table that holds `name`."""
    selects: list[Select] = []
    if labels is None:
        if name in SAMPLE_COLUMNS:
            t = SampleRow.__table__
            col = t.c[SAMPLE_COLUMNS[name]]
            stmt = select(t.c.instance, t.c.ts, col.label("value")).where(
                t.c.ts >= start, t.c.ts < end, col.is_not(None)
            )
            selects.append(stmt.where(t.c.instance.in_(instances)) if instances is not None else stmt)
        if name in STEP_COLUMNS:
            t = StepRow.__table__
            col = (t.c.prefill_tokens + t.c.decode_tokens) if name == "step_tokens" else t.c[STEP_COLUMNS[name]]
            stmt = select(t.c.instance, t.c.ts, col.label("value")).where(
                t.c.ts >= start, t.c.ts < end, t.c.warmup.is_(False)
            )
            selects.append(stmt.where(t.c.instance.in_(instances)) if instances is not None else stmt)
    if labels is None and name in EVENT_COUNTERS:
        selects.append(_event_counter(name, start, end, instances))
    # Scraped points; several label sets of one instance (GPUs, directions) are combined per scrape:
    # averaged for ratios, summed for amounts and counters.
    t = SeriesPoint.__table__
    agg = func.avg if is_ratio_series(name) else func.sum
    conds = [t.c.name == name, t.c.ts >= start, t.c.ts < end]
    if instances is not None:
        conds.append(t.c.instance.in_(instances))
    if labels is not None:
        conds.append(t.c.labels == json.dumps(dict(sorted(labels.items())), separators=(",", ":")))
    selects.append(
        select(t.c.instance, t.c.ts, agg(t.c.value).label("value")).where(*conds).group_by(t.c.instance, t.c.ts)
    )
    # Downsampled history (written by prune): bucket averages, stamped at the bucket's middle.
    d = DownsampledPoint.__table__
    dconds = [d.c.name == name, d.c.bucket_ts >= start, d.c.bucket_ts < end]
    if instances is not None:
        dconds.append(d.c.instance.in_(instances))
    if labels is None:
        selects.append(
            select(
                d.c.instance,
                (d.c.bucket_ts + d.c.bucket_s / 2).label("ts"),
                (func.sum(d.c.sum) / func.sum(d.c.count)).label("value"),
            )
            .where(*dconds)
            .group_by(d.c.instance, d.c.bucket_ts, d.c.bucket_s)
        )
    return selects


# Counters that pushed telemetry carries as events rather than as a counter: a request refused at
# admission is a `requests` row with status 'rejected', a failed KV growth an `alloc_events` row with op
# 'oom'. They are served as cumulative counts stamped at each sample of the instance, counted from the
# window's start: increase() and rate() only need differences, and a sample grid gives them two points
# even when one event is all the window holds.
EVENT_COUNTERS: dict[str, tuple[Any, str, str]] = {
    "requests_rejected_total": (RequestRow, "status", "rejected"),
    "oom_total": (AllocRow, "op", "oom"),
}


def _event_counter(name: str, start: float, end: float, instances: Sequence[str] | None) -> Select:
    table_cls, column, value = EVENT_COUNTERS[name]
    ev = table_cls.__table__.alias("ev")
    smp = SampleRow.__table__
    count = (
        select(func.count())
        .where(ev.c.instance == smp.c.instance, ev.c[column] == value, ev.c.ts >= start, ev.c.ts <= smp.c.ts)
        .scalar_subquery()
    )
    stmt = select(smp.c.instance, smp.c.ts, cast(count, Float).label("value")).where(smp.c.ts >= start, smp.c.ts < end)
    return stmt.where(smp.c.instance.in_(instances)) if instances is not None else stmt


def series_points(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
) -> Points:
    """instance -> [(ts, value)] sorted by ts, for any canonical series, from whichever table holds it.

    `memory_usage` is derived as used/total at the same timestamp; `up` comes from scrape health.
    `labels` selects one label set of a scraped series (e.g. {"direction": "out"}).
    """
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}; known: {', '.join(list_series_names())}")
    if name == "memory_usage":
        return _memory_usage(db, start=start, end=end, instances=instances)
    selects = _sources(name, start, end, instances, labels)
    stmt = union_all(*selects) if len(selects) > 1 else selects[0]
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with _bound(db) as conn:
        for instance, ts, value in conn.execute(stmt):
            out[instance].append((float(ts), float(value)))
    for points in out.values():
        points.sort()
    return dict(out)


def _memory_usage(db: Db, *, start: float, end: float, instances: Sequence[str] | None) -> Points:
    used = series_points(db, name="memory_used_bytes", start=start, end=end, instances=instances)
    total = series_points(db, name="memory_total_bytes", start=start, end=end, instances=instances)
    out: Points = {}
    for instance, points in used.items():
        totals = dict(total.get(instance, []))
        usage = [(ts, u / totals[ts]) for ts, u in points if totals.get(ts)]
        if usage:
            out[instance] = usage
    return out


def bucketed(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
) -> Points:
    """instance -> [(bucket_start, average)] of a canonical series, downsampled in SQL."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    if name == "memory_usage":
        raw = series_points(db, name=name, start=start, end=end, instances=instances)
        return {inst: _py_buckets(points, bucket_s) for inst, points in raw.items()}
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}")
    with _bound(db) as conn:
        dialect = _dialect(conn)
        inner = union_all(*_sources(name, start, end, instances, None)).subquery()
        b = bucket_expr(inner.c.ts, bucket_s, dialect).label("bucket")
        stmt = (
            select(inner.c.instance, b, func.avg(inner.c.value))
            .group_by(inner.c.instance, b)
            .order_by(inner.c.instance, b)
        )
        out: Points = defaultdict(list)
        for instance, bucket, value in conn.execute(stmt):
            out[instance].append((float(bucket), float(value)))
    return dict(out)


def _py_buckets(points: list[tuple[float, float]], bucket_s: float) -> list[tuple[float, float]]:
    acc: dict[float, list[float]] = defaultdict(list)
    for ts, v in points:
        acc[math.floor(ts / bucket_s) * bucket_s].append(v)
    return [(b, sum(vs) / len(vs)) for b, vs in sorted(acc.items())]


def counter_increase(
    db: Db, *, name: str, start: float, end: float, instances: Sequence[str] | None = None
) -> dict[str, float]:
    """instance -> increase of a counter over the window, counting a drop as a reset (Prometheus rules)."""
    out: dict[str, float] = {}
    for instance, points in series_points(db, name=name, start=start, end=end, instances=instances).items():
        total = 0.0
        for (_, prev), (_, cur) in itertools.pairwise(points):
            total += cur - prev if cur >= prev else cur
        out[instance] = total
    return out


def counter_rate(
    db: Db, *, name: str, start: float, end: float, instances: Sequence[str] | None = None
) -> dict[str, float]:
    """instance -> per-second rate of a counter between its first and last point in the window."""
    points = series_points(db, name=name, start=start, end=end, instances=instances)
    increases = counter_increase(db, name=name, start=start, end=end, instances=instances)
    out = {}
    for instance, pts in points.items():
        span = pts[-1][0] - pts[0][0] if len(pts) > 1 else 0.0
        out[instance] = increases[instance] / span if span > 0 else 0.0
    return out
