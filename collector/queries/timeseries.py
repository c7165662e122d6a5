"""Canonical series over time, one per label set, from whichever table holds them.

A series is (canonical name, instance, label set) — `SeriesId(instance, labels)`. Engine-pushed gauges
(samples, steps, event counters) have no labels, but for `events_lost_total{kind, reason}` (gap records);
scraped series keep the identifying labels of their
source (model, engine, GPU, MIG instance, host, target labels such as `node`). Nothing here combines
label sets: where an average or a sum over GPUs is meant, the caller says so (the rules with
`avg by (...)`, the dashboard with its own grouping), so one full GPU is never hidden by an empty one.

Downsampled history (`kvpilot db prune`) is read as bucket averages stamped at the bucket's middle; raw
and downsampled rows never overlap (retention aligns its cutoff to the bucket).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Float, Select, Text, cast, func, literal, select, true, union_all

from collector.queries._base import Db, _bound, _dialect, bucket_expr, scope
from collector.schema import (
    AllocRow,
    DownsampledPoint,
    GapRow,
    Instance,
    RequestRow,
    SampleRow,
    SeriesPoint,
    StepRow,
)
from collector.series import CANONICAL, SAMPLE_COLUMNS, STEP_COLUMNS, list_series_names

Labels = tuple[tuple[str, str], ...]


class SeriesId(NamedTuple):
    """One stored series of a canonical name: its instance and its other labels, sorted."""

    instance: str
    labels: Labels = ()

    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    def all_labels(self) -> Labels:
        """The label set with `instance`, sorted: what a rule sees (without `__name__`)."""
        return tuple(sorted((*self.labels, ("instance", self.instance))))


Series = dict[SeriesId, list[tuple[float, float]]]
_NO_LABELS = "{}"


@lru_cache(maxsize=65_536)
def parse_labels(stored: str) -> Labels:
    """The stored sorted-JSON form of a label set -> sorted pairs (memoised: a few thousand distinct sets)."""
    return tuple(sorted(json.loads(stored).items())) if stored and stored != _NO_LABELS else ()


def _engine_sources(name: str, start: float, end: float, instances: Sequence[str] | None) -> list[Select]:
    """SELECT (instance, labels, ts, value) from the engine event tables that hold `name` (no labels)."""
    selects: list[Select] = []
    no_labels = cast(literal(_NO_LABELS), Text).label("labels")
    if name in SAMPLE_COLUMNS:
        t = SampleRow.__table__
        col = t.c[SAMPLE_COLUMNS[name]]
        selects.append(
            select(t.c.instance, no_labels, t.c.ts, col.label("value")).where(
                t.c.ts >= start, t.c.ts < end, col.is_not(None)
            )
        )
    if name in STEP_COLUMNS:
        t = StepRow.__table__
        step_col = (t.c.prefill_tokens + t.c.decode_tokens) if name == "step_tokens" else t.c[STEP_COLUMNS[name]]
        selects.append(
            select(t.c.instance, no_labels, t.c.ts, step_col.label("value")).where(
                t.c.ts >= start, t.c.ts < end, t.c.warmup.is_(False)
            )
        )
    if name in EVENT_COUNTERS:
        selects.append(_event_counter(name, start, end))
    if name == LOST_COUNTER:
        selects.extend(_lost_counter(start, end))
    if instances is not None:
        selects = [s.where(s.selected_columns[0].in_(instances)) for s in selects]
    return selects


def _sources(name: str, start: float, end: float, instances: Sequence[str] | None) -> list[Select]:
    """One SELECT (instance, labels, ts, value) per table that holds `name`."""
    return [*_engine_sources(name, start, end, instances), *_scraped_sources(name, start, end, instances)]


def _scraped_sources(name: str, start: float, end: float, instances: Sequence[str] | None) -> list[Select]:
    """SELECT (instance, labels, ts, value) from the scraped series' points and their downsampled rows."""
    selects: list[Select] = []
    t = SeriesPoint.__table__
    conds = [t.c.name == name, *scope(t, start, end, instances, None)]
    selects.append(select(t.c.instance, t.c.labels, t.c.ts, t.c.value).where(*conds))
    d = DownsampledPoint.__table__
    dconds = [d.c.name == name, *scope(d, start, end, instances, None, ts="bucket_ts")]
    selects.append(
        select(
            d.c.instance,
            d.c.labels,
            (d.c.bucket_ts + d.c.bucket_s / 2).label("ts"),
            (func.sum(d.c.sum) / func.sum(d.c.count)).label("value"),
        )
        .where(*dconds)
        .group_by(d.c.instance, d.c.labels, d.c.bucket_ts, d.c.bucket_s)
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


def _event_counter(name: str, start: float, end: float) -> Select:
    table_cls, column, value = EVENT_COUNTERS[name]
    ev = table_cls.__table__.alias("ev")
    smp = SampleRow.__table__
    count = (
        select(func.count())
        .where(ev.c.instance == smp.c.instance, ev.c[column] == value, ev.c.ts >= start, ev.c.ts <= smp.c.ts)
        .where(ev.c.ts < end)  # implied by the sample's ts < end; said outright, it prunes later day partitions
        .scalar_subquery()
    )
    no_labels = cast(literal(_NO_LABELS), Text).label("labels")
    return select(smp.c.instance, no_labels, smp.c.ts, cast(count, Float).label("value")).where(
        smp.c.ts >= start, smp.c.ts < end
    )


# Telemetry a sink lost, from the `gaps` table, per (kind, reason): counted from the window's start like the
# EVENT_COUNTERS, stamped at each sample of the instance and on both sides of each gap record (a point a
# millisecond before it without it, one at it with it), so increase() sees every record's step even when
# the samples around it were lost too.
LOST_COUNTER = "events_lost_total"
_JUST_BEFORE_S = 1e-3


def _lost_labels(kind: Any, reason: Any) -> Any:
    # kind and reason are closed vocabularies (engine.events), so plain concatenation is valid JSON.
    return (literal('{"kind":"', Text) + kind + '","reason":"' + reason + '"}').label("labels")


def _lost_upto(key: Any, start: float, upto: Any) -> Any:
    """Events lost by `key`'s (instance, kind, reason) from `start` through the gap records `upto` selects."""
    other = GapRow.__table__.alias("other")
    total = select(func.coalesce(func.sum(other.c.events), 0)).where(
        other.c.instance == key.c.instance,
        other.c.kind == key.c.kind,
        other.c.reason == key.c.reason,
        other.c.ts >= start,
        upto(other.c.ts),
    )
    return cast(total.scalar_subquery(), Float).label("value")


def _lost_counter(start: float, end: float) -> list[Select]:
    gap = GapRow.__table__
    in_window = (gap.c.ts >= start, gap.c.ts < end)
    labels = _lost_labels(gap.c.kind, gap.c.reason)
    before = select(
        gap.c.instance, labels, (gap.c.ts - _JUST_BEFORE_S).label("ts"), _lost_upto(gap, start, lambda t: t < gap.c.ts)
    ).where(*in_window, gap.c.ts - _JUST_BEFORE_S >= start)
    at = select(gap.c.instance, labels, gap.c.ts, _lost_upto(gap, start, lambda t: t <= gap.c.ts)).where(*in_window)
    keys = select(gap.c.instance, gap.c.kind, gap.c.reason).where(*in_window).distinct().subquery("lost")
    smp = SampleRow.__table__
    grid = (
        select(
            smp.c.instance,
            _lost_labels(keys.c.kind, keys.c.reason),
            smp.c.ts,
            _lost_upto(keys, start, lambda t: t <= smp.c.ts),
        )
        .join_from(smp, keys, keys.c.instance == smp.c.instance)
        .where(smp.c.ts >= start, smp.c.ts < end)
    )
    return [before, at, grid]


def _matches(labels: Labels, wanted: dict[str, str] | None) -> bool:
    if not wanted:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in wanted.items())


def series_points(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
) -> Series:
    """SeriesId -> [(ts, value)] sorted by ts, for any canonical series, one entry per label set.

    `labels` keeps the series whose labels include these pairs (e.g. {"gpu": "1"}); engine series have
    none, so any label filter excludes them. `memory_usage` is derived as used / total of the same
    series at the same timestamp; `up` comes from scrape health.
    """
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}; known: {', '.join(list_series_names())}")
    if name == "memory_usage":
        return _memory_usage(db, start=start, end=end, instances=instances, labels=labels)
    return raw_series(db, name=name, start=start, end=end, instances=instances, labels=labels)


def raw_series(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
    pushed: bool = True,
) -> Series:
    """`series_points` without the name check or derived series (histogram buckets are read through this);
    `pushed` False leaves out the engine event tables (the scraped series alone)."""
    selects = _sources(name, start, end, instances) if pushed else _scraped_sources(name, start, end, instances)
    stmt = union_all(*selects) if len(selects) > 1 else selects[0]
    out: Series = defaultdict(list)
    with _bound(db) as conn:
        for instance, stored, ts, value in conn.execute(stmt):
            series_labels = parse_labels(stored)
            if _matches(series_labels, labels):
                out[SeriesId(instance, series_labels)].append((float(ts), float(value)))
    for points in out.values():
        points.sort()
    return dict(out)


def latest_points(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
) -> dict[SeriesId, tuple[float, float]]:
    """SeriesId -> its newest (ts, value) in [start, end): what an instant selector reads (a rule's `queue_depth`
    is each series' newest sample within the lookback).

    Reading every point of the window to keep one is what `series_points` would cost: a fleet's engines sample
    every second, so a 5-minute lookback over 1,000 of them is 300,000 rows an evaluation. On PostgreSQL an engine
    gauge is read one index probe per instance seen since `start` (`instances.last_seen_ts`, (instance, ts) on
    `samples`, newest first); scraped series (a point every scrape interval) and every other source are read
    as `series_points` and reduced. The answer is the same either way."""
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}; known: {', '.join(list_series_names())}")
    out: dict[SeriesId, tuple[float, float]] = {}
    with _bound(db) as conn:
        probed = name in SAMPLE_COLUMNS and name not in STEP_COLUMNS and _dialect(conn) == "postgresql"
        if probed:
            for instance, ts, value in conn.execute(_newest_samples(name, start, end, instances)):
                out[SeriesId(instance)] = (float(ts), float(value))
            rest = raw_series(conn, name=name, start=start, end=end, instances=instances, pushed=False)
        else:
            rest = series_points(conn, name=name, start=start, end=end, instances=instances)
    for sid, points in rest.items():
        if points and (sid not in out or points[-1][0] > out[sid][0]):
            out[sid] = points[-1]
    return out


def _newest_samples(name: str, start: float, end: float, instances: Sequence[str] | None) -> Select:
    """Per instance seen since `start`, its newest sample of the gauge in [start, end) (a LATERAL index probe)."""
    i = Instance.__table__.c
    t = SampleRow.__table__
    col = t.c[SAMPLE_COLUMNS[name]]
    newest = (
        select(t.c.ts, col.label("value"))
        .where(t.c.instance == i.name, t.c.ts >= start, t.c.ts < end, col.is_not(None))
        .order_by(t.c.ts.desc())
        .limit(1)
        .lateral("newest")
    )
    stmt = select(i.name, newest.c.ts, newest.c.value).select_from(Instance.__table__.join(newest, true()))
    stmt = stmt.where(i.last_seen_ts >= start)
    return stmt if instances is None else stmt.where(i.name.in_(instances))


def series_instances(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    engines: Sequence[str] | None = None,
) -> set[str]:
    """The instances with a point of `name` in the window (one row each, not their points). `engines`: only these
    instances' engine events are looked at (the scraped series of every instance still are), for a caller that
    already knows which engines can count: a fleet's hour of samples is millions of rows to find none in."""
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}; known: {', '.join(list_series_names())}")
    if name == "memory_usage":
        name = "memory_used_bytes"
    if engines is None:
        selects = _sources(name, start, end, instances)
    else:
        allowed = None if instances is None else set(instances)
        wanted = [e for e in engines if allowed is None or e in allowed]
        pushed = _engine_sources(name, start, end, wanted) if wanted else []
        selects = [*pushed, *_scraped_sources(name, start, end, instances)]
    inner = union_all(*selects).subquery()
    with _bound(db) as conn:
        return set(conn.execute(select(inner.c.instance).distinct()).scalars())


def _memory_usage(
    db: Db, *, start: float, end: float, instances: Sequence[str] | None, labels: dict[str, str] | None
) -> Series:
    used = series_points(db, name="memory_used_bytes", start=start, end=end, instances=instances, labels=labels)
    total = series_points(db, name="memory_total_bytes", start=start, end=end, instances=instances, labels=labels)
    out: Series = {}
    for sid, points in used.items():
        totals = dict(total.get(sid, []))
        usage = [(ts, u / totals[ts]) for ts, u in points if totals.get(ts)]
        if usage:
            out[sid] = usage
    return out


def bucketed(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
    agg: str = "avg",
) -> Series:
    """SeriesId -> [(bucket_start, value)] of a canonical series downsampled in SQL; `agg` is avg or max.

    `max` is what a chart next to a `> threshold` rule must show: an average hides the peak that fired it.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    if agg not in _BUCKET_AGGS:
        raise ValueError(f"agg must be one of {sorted(_BUCKET_AGGS)}, got {agg!r}")
    if name == "memory_usage":
        raw = series_points(db, name=name, start=start, end=end, instances=instances, labels=labels)
        return {sid: _py_buckets(points, bucket_s, agg) for sid, points in raw.items()}
    if name not in CANONICAL:
        raise ValueError(f"unknown series {name!r}")
    with _bound(db) as conn:
        inner = union_all(*_sources(name, start, end, instances)).subquery()
        b = bucket_expr(inner.c.ts, bucket_s, _dialect(conn)).label("bucket")
        stmt = (
            select(inner.c.instance, inner.c.labels, b, _BUCKET_AGGS[agg](inner.c.value))
            .group_by(inner.c.instance, inner.c.labels, b)
            .order_by(inner.c.instance, inner.c.labels, b)
        )
        out: Series = defaultdict(list)
        for instance, stored, bucket, value in conn.execute(stmt):
            series_labels = parse_labels(stored)
            if _matches(series_labels, labels):
                out[SeriesId(instance, series_labels)].append((float(bucket), float(value)))
    return dict(out)


_BUCKET_AGGS: dict[str, Callable[[Any], ColumnElement[Any]]] = {"avg": func.avg, "max": func.max}


def _py_buckets(points: list[tuple[float, float]], bucket_s: float, agg: str = "avg") -> list[tuple[float, float]]:
    acc: dict[float, list[float]] = defaultdict(list)
    for ts, v in points:
        acc[math.floor(ts / bucket_s) * bucket_s].append(v)
    combine = max if agg == "max" else (lambda vs: sum(vs) / len(vs))
    return [(b, combine(vs)) for b, vs in sorted(acc.items())]


def increase_of(points: Sequence[tuple[float, float]]) -> float:
    """A counter's increase over consecutive points, a drop counted as a reset (Prometheus rules)."""
    total = 0.0
    for (_, prev), (_, cur) in itertools.pairwise(points):
        total += cur - prev if cur >= prev else cur
    return total


def counter_increase(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[SeriesId, float]:
    """SeriesId -> increase of a counter over the window, counting a drop as a reset."""
    points = series_points(db, name=name, start=start, end=end, instances=instances, labels=labels)
    return {sid: increase_of(pts) for sid, pts in points.items()}


def counter_rate(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    instances: Sequence[str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[SeriesId, float]:
    """SeriesId -> per-second rate of a counter between its first and last point in the window."""
    out = {}
    for sid, pts in series_points(db, name=name, start=start, end=end, instances=instances, labels=labels).items():
        span = pts[-1][0] - pts[0][0] if len(pts) > 1 else 0.0
        out[sid] = increase_of(pts) / span if span > 0 else 0.0
    return out


def group_sum(values: dict[SeriesId, float], by: Sequence[str] = ("instance",)) -> dict[SeriesId, float]:
    """Sum values over the series that share the `by` labels (`sum by (...)`), e.g. tokens/s per instance."""
    out: dict[SeriesId, float] = defaultdict(float)
    for sid, value in values.items():
        out[group_key(sid, by)] += value
    return dict(out)


def group_key(sid: SeriesId, by: Sequence[str]) -> SeriesId:
    """The SeriesId that keeps only the `by` labels (instance is '' unless kept)."""
    kept = tuple(p for p in sid.labels if p[0] in by)
    return SeriesId(sid.instance if "instance" in by else "", kept)
