"""The one read path for alerts, tuner and dashboard: windows, rates, percentiles, series over time.

Every function is keyword-only after its first argument, which may be a Session, a Connection or an
Engine. Times are epoch seconds; windows are half-open, `start <= ts < end`.

Percentiles are exact, by the nearest-rank definition: for n values sorted ascending, the q-quantile
is the k-th value with k = ceil(q * n) (k >= 1). They are computed in SQL with ROW_NUMBER/COUNT window
functions, which SQLite (>= 3.25) and PostgreSQL evaluate identically; the contract tests check both
against a Python reference.

Downsampling (`bucketed`, `kv_over_time`, `throughput_over_time`) groups in SQL by
`floor(ts / bucket_s) * bucket_s`: the value of a bucket is the average of the points in it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection, Engine, Float, Integer, Select, and_, case, cast, func, literal, select, union_all
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from collector.db import translate_errors
from collector.schema import (
    AllocRow,
    DownsampledPoint,
    Instance,
    RequestRow,
    Run,
    SampleRow,
    ScrapeTarget,
    SeriesPoint,
    StepRow,
)
from collector.series import CANONICAL, SAMPLE_COLUMNS, STEP_COLUMNS
from collector.series import list_series_names as _list_series_names

Db = Session | Connection | Engine
GroupBy = Literal["instance", "run", "all"]
LatencyMetric = Literal["ttft", "e2e", "queue", "prefill", "decode", "swap", "tpot"]
Points = dict[str, list[tuple[float, float]]]

DEFAULT_QUANTILES = (0.5, 0.9, 0.95, 0.99)


@contextlib.contextmanager
def _bound(db: Db) -> Iterator[Session | Connection]:
    with translate_errors():
        if isinstance(db, Engine):
            with db.connect() as conn:
                yield conn
        else:
            yield db


def _dialect(conn: Session | Connection) -> str:
    bind = conn.get_bind() if isinstance(conn, Session) else conn
    return bind.dialect.name


def bucket_expr(col: ColumnElement, bucket_s: float, dialect: str) -> ColumnElement:
    """floor(ts / w) * w. SQLite has no floor() without its math extension; CAST truncates, = floor for ts > 0."""
    width = literal(float(bucket_s))
    if dialect == "sqlite":
        return cast(cast(col / width, Integer), Float) * width
    return func.floor(col / width) * width


def list_series_names() -> list[str]:
    """Every canonical series name `series_points` answers for."""
    return _list_series_names()


# --- instances, runs, targets ----------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceInfo:
    name: str
    first_seen_ts: float
    last_seen_ts: float


@dataclass(frozen=True)
class RunInfo:
    instance: str
    run_id: str
    first_seen_ts: float
    last_seen_ts: float


@dataclass(frozen=True)
class TargetHealth:
    id: int
    url: str
    job: str
    instance: str
    up: bool | None
    last_error: str | None
    last_scrape_at: float | None
    scrape_duration_s: float | None
    interval_s: float
    enabled: bool


def list_instances(db: Db) -> list[InstanceInfo]:
    t = Instance.__table__
    with _bound(db) as conn:
        rows = conn.execute(select(t.c.name, t.c.first_seen_ts, t.c.last_seen_ts).order_by(t.c.name)).all()
    return [InstanceInfo(*r) for r in rows]


def list_runs(db: Db, *, instance: str | None = None) -> list[RunInfo]:
    t = Run.__table__
    stmt = select(t.c.instance, t.c.run_id, t.c.first_seen_ts, t.c.last_seen_ts)
    if instance is not None:
        stmt = stmt.where(t.c.instance == instance)
    with _bound(db) as conn:
        rows = conn.execute(stmt.order_by(t.c.last_seen_ts.desc(), t.c.instance, t.c.run_id)).all()
    return [RunInfo(*r) for r in rows]


def target_health(db: Db) -> list[TargetHealth]:
    t = ScrapeTarget.__table__
    stmt = select(
        t.c.id,
        t.c.url,
        t.c.job,
        t.c.instance,
        t.c.up,
        t.c.last_error,
        t.c.last_scrape_at,
        t.c.scrape_duration_s,
        t.c.interval_s,
        t.c.enabled,
    ).order_by(t.c.id)
    with _bound(db) as conn:
        return [TargetHealth(*r) for r in conn.execute(stmt).all()]


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


# --- requests: percentiles, rates, goodput ---------------------------------------------------------


@dataclass(frozen=True)
class LatencyStats:
    group: str
    count: int
    mean: float | None
    max: float | None
    quantiles: dict[float, float | None]


def _metric_column(metric: LatencyMetric) -> ColumnElement:
    r = RequestRow.__table__.c
    columns: dict[str, ColumnElement] = {
        "ttft": r.ttft_s,
        "e2e": r.e2e_s,
        "queue": r.queue_s,
        "prefill": r.prefill_s,
        "decode": r.decode_s,
        "swap": r.swap_s,
        "tpot": case((r.output_tokens > 1, r.decode_s / (r.output_tokens - 1)), else_=None),
    }
    if metric not in columns:
        raise ValueError(f"metric must be one of {sorted(columns)}, got {metric!r}")
    return columns[metric]


def _group_column(group_by: GroupBy) -> ColumnElement:
    r = RequestRow.__table__.c
    if group_by == "instance":
        return r.instance
    if group_by == "run":
        return r.run_id
    if group_by == "all":
        return literal("all")
    raise ValueError(f"group_by must be instance, run or all, got {group_by!r}")


def _request_filter(
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    statuses: Sequence[str] | None,
    include_warmup: bool,
) -> list[ColumnElement]:
    r = RequestRow.__table__.c
    conds: list[ColumnElement] = [r.ts >= start, r.ts < end]
    if instances is not None:
        conds.append(r.instance.in_(instances))
    if run_id is not None:
        conds.append(r.run_id == run_id)
    if statuses is not None:
        conds.append(r.status.in_(statuses))
    if not include_warmup:
        conds.append(r.warmup.is_(False))
    return conds


def latency_percentiles(
    db: Db,
    *,
    start: float,
    end: float,
    metric: LatencyMetric = "ttft",
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    group_by: GroupBy = "instance",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    statuses: Sequence[str] | None = ("finished",),
    include_warmup: bool = False,
) -> list[LatencyStats]:
    """Exact nearest-rank quantiles of a request stage (ttft, e2e, queue, prefill, decode, swap, tpot) per group.

    `swap` is the time swapped out to the host tier, which also counts inside prefill or decode.
    """
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles must be within [0, 1], got {q}")
    value = _metric_column(metric).label("v")
    group = _group_column(group_by).label("g")
    conds = _request_filter(start, end, instances, run_id, statuses, include_warmup)
    ranked = (
        select(
            group,
            value,
            func.row_number().over(partition_by=group, order_by=value).label("rn"),
            func.count().over(partition_by=group).label("n"),
        )
        .where(*conds, _metric_column(metric).is_not(None))
        .subquery()
    )
    cols: list[Any] = [ranked.c.g, func.count(), func.avg(ranked.c.v), func.max(ranked.c.v)]
    for q in quantiles:
        # the smallest rank k with k >= q*n, i.e. k = ceil(q*n); rank 1 when q*n <= 1
        cols.append(func.min(case((ranked.c.rn >= literal(float(q)) * ranked.c.n, ranked.c.v), else_=None)))
    stmt = select(*cols).group_by(ranked.c.g).order_by(ranked.c.g)
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    out = []
    for row in rows:
        qs = {float(q): (None if v is None else float(v)) for q, v in zip(quantiles, row[4:], strict=True)}
        out.append(
            LatencyStats(
                group=str(row[0]),
                count=int(row[1]),
                mean=None if row[2] is None else float(row[2]),
                max=None if row[3] is None else float(row[3]),
                quantiles=qs,
            )
        )
    return out


@dataclass(frozen=True)
class RequestRates:
    group: str
    requests: int
    finished: int
    failed: int
    rejected: int
    aborted: int
    window_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float


def request_rates(
    db: Db,
    *,
    start: float,
    end: float,
    group_by: GroupBy = "instance",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[RequestRates]:
    """Requests by status and token throughput (finished requests' tokens / window length) per group."""
    if end <= start:
        raise ValueError("end must be after start")
    r = RequestRow.__table__.c
    group = _group_column(group_by).label("g")
    conds = _request_filter(start, end, instances, run_id, None, include_warmup)

    def count_status(status: str) -> ColumnElement:
        return func.sum(case((r.status == status, 1), else_=0))

    def finished_sum(col: ColumnElement) -> ColumnElement:
        return func.sum(case((r.status == "finished", col), else_=0))

    stmt = (
        select(
            group,
            func.count(),
            count_status("finished"),
            count_status("failed"),
            count_status("rejected"),
            count_status("aborted"),
            finished_sum(r.prompt_tokens),
            finished_sum(r.output_tokens),
        )
        .where(*conds)
        .group_by(group)
        .order_by(group)
    )
    window = end - start
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    return [
        RequestRates(
            group=str(g),
            requests=int(n),
            finished=int(fin or 0),
            failed=int(fail or 0),
            rejected=int(rej or 0),
            aborted=int(ab or 0),
            window_s=window,
            requests_per_s=int(n) / window,
            prompt_tokens_per_s=float(pt or 0) / window,
            output_tokens_per_s=float(ot or 0) / window,
        )
        for g, n, fin, fail, rej, ab, pt, ot in rows
    ]


@dataclass(frozen=True)
class Goodput:
    group: str
    requests: int
    good: int
    fraction: float
    good_per_s: float


def goodput(
    db: Db,
    *,
    start: float,
    end: float,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    e2e_slo_s: float | None = None,
    group_by: GroupBy = "instance",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[Goodput]:
    """Requests that finished within every given SLO, over all requests that left the engine.

    A failed, rejected or aborted request is never good; a missing TTFT fails a TTFT SLO.
    TPOT is decode time per output token after the first (requests with one token meet any TPOT SLO).
    """
    if end <= start:
        raise ValueError("end must be after start")
    r = RequestRow.__table__.c
    good_conds: list[ColumnElement] = [r.status == "finished"]
    if ttft_slo_s is not None:
        good_conds.append(and_(r.ttft_s.is_not(None), r.ttft_s <= ttft_slo_s))
    if tpot_slo_s is not None:
        good_conds.append(case((r.output_tokens > 1, r.decode_s <= tpot_slo_s * (r.output_tokens - 1)), else_=True))
    if e2e_slo_s is not None:
        good_conds.append(r.e2e_s <= e2e_slo_s)
    group = _group_column(group_by).label("g")
    stmt = (
        select(group, func.count(), func.sum(case((and_(*good_conds), 1), else_=0)))
        .where(*_request_filter(start, end, instances, run_id, None, include_warmup))
        .group_by(group)
        .order_by(group)
    )
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    window = end - start
    return [
        Goodput(
            group=str(g),
            requests=int(n),
            good=int(good or 0),
            fraction=(int(good or 0) / int(n)) if n else 0.0,
            good_per_s=int(good or 0) / window,
        )
        for g, n, good in rows
    ]


def slowest_requests(
    db: Db,
    *,
    start: float,
    end: float,
    metric: LatencyMetric = "e2e",
    limit: int = 20,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[dict[str, Any]]:
    """The `limit` requests with the largest `metric`, as plain dicts (all request columns)."""
    t = RequestRow.__table__
    value = _metric_column(metric)
    stmt = (
        select(t, value.label("metric_value"))
        .where(*_request_filter(start, end, instances, run_id, None, include_warmup), value.is_not(None))
        .order_by(value.desc(), t.c.id)
        .limit(max(0, int(limit)))
    )
    with _bound(db) as conn:
        return [dict(row._mapping) for row in conn.execute(stmt)]


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
    """instance -> bucketed averages of KV usage, cold usage, fragmentation and internal waste."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    s = SampleRow.__table__.c
    with _bound(db) as conn:
        b = bucket_expr(s.ts, bucket_s, _dialect(conn)).label("bucket")
        conds = [s.ts >= start, s.ts < end]
        if instances is not None:
            conds.append(s.instance.in_(instances))
        if run_id is not None:
            conds.append(s.run_id == run_id)
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
        out: dict[str, list[KvBucket]] = defaultdict(list)
        for inst, bucket, kv, cold, frag, waste, n in conn.execute(stmt):
            out[inst].append(KvBucket(float(bucket), _f(kv), _f(cold), _f(frag), _f(waste), int(n)))
    return dict(out)


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
    """instance -> per-bucket engine throughput from step events (tokens/s, step time, busy fraction)."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    st = StepRow.__table__.c
    with _bound(db) as conn:
        b = bucket_expr(st.ts, bucket_s, _dialect(conn)).label("bucket")
        conds = [st.ts >= start, st.ts < end, st.warmup.is_(False)]
        if instances is not None:
            conds.append(st.instance.in_(instances))
        if run_id is not None:
            conds.append(st.run_id == run_id)
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


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


# --- dashboard read helpers (added for the dashboard, issue 6) -------------------------------------
# Per-bucket latency quantiles, the stage breakdown, histograms, the KV allocation trace and the latest
# gauges. All downsampled in SQL (one row per bucket), so a week-long range stays a few hundred rows.


def _int_floor(expr: ColumnElement, dialect: str) -> ColumnElement:
    """floor() as an integer; SQLite's CAST truncates (= floor for x >= 0), PostgreSQL's CAST rounds."""
    if dialect == "sqlite":
        return cast(expr, Integer)
    return cast(func.floor(expr), Integer)


@dataclass(frozen=True)
class QuantileBucket:
    ts: float
    count: int
    mean: float
    quantiles: dict[float, float | None]


def latency_quantiles_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    metric: LatencyMetric = "ttft",
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    statuses: Sequence[str] | None = ("finished",),
    include_warmup: bool = False,
) -> list[QuantileBucket]:
    """Exact nearest-rank quantiles of a request stage per time bucket (the same definition as latency_percentiles)."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles must be within [0, 1], got {q}")
    r = RequestRow.__table__.c
    column = _metric_column(metric)
    conds = _request_filter(start, end, instances, run_id, statuses, include_warmup)
    with _bound(db) as conn:
        bucket = bucket_expr(r.ts, bucket_s, _dialect(conn)).label("b")
        ranked = (
            select(
                bucket,
                column.label("v"),
                func.row_number().over(partition_by=bucket, order_by=column).label("rn"),
                func.count().over(partition_by=bucket).label("n"),
            )
            .where(*conds, column.is_not(None))
            .subquery()
        )
        cols: list[Any] = [ranked.c.b, func.count(), func.avg(ranked.c.v)]
        for q in quantiles:
            cols.append(func.min(case((ranked.c.rn >= literal(float(q)) * ranked.c.n, ranked.c.v), else_=None)))
        rows = conn.execute(select(*cols).group_by(ranked.c.b).order_by(ranked.c.b)).all()
    return [
        QuantileBucket(
            ts=float(row[0]),
            count=int(row[1]),
            mean=float(row[2]),
            quantiles={float(q): _f(v) for q, v in zip(quantiles, row[3:], strict=True)},
        )
        for row in rows
    ]


@dataclass(frozen=True)
class StageBucket:
    """Mean seconds per request stage in one bucket; the stacked stages add up to the mean end-to-end latency.

    The stacked stages are queue, prefill, first-token gap, decode excluding swap and swap. The engine
    counts time swapped out to the host tier inside the stage it interrupted, so `decode_excl_swap_s`
    is the mean of decode - swap per request (clamped at 0), `swap_s` the mean swap time, and
    `first_token_gap_s` what is left of e2e: e2e - queue - prefill - decode, prefill done to first
    token, except that a request swapped out longer than it decoded (swapped during prefill) gives the
    excess back there, so the five still add up (unless the excess is longer than the gap, rare: the
    gap is clamped at 0). `decode_s` is the whole decode stage, swap included.
    """

    ts: float
    requests: int
    queue_s: float
    prefill_s: float
    first_token_gap_s: float
    decode_excl_swap_s: float
    swap_s: float
    decode_s: float
    e2e_s: float
    swaps: int
    preemptions: int


def stage_breakdown_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[StageBucket]:
    """Per bucket: mean queue, prefill, first-token gap, decode and swap seconds of finished requests, and counts."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    r = RequestRow.__table__.c
    conds = _request_filter(start, end, instances, run_id, ("finished",), include_warmup)
    decode_excl_swap = case((r.decode_s > r.swap_s, r.decode_s - r.swap_s), else_=literal(0.0))
    with _bound(db) as conn:
        bucket = bucket_expr(r.ts, bucket_s, _dialect(conn)).label("b")
        stmt = (
            select(
                bucket,
                func.count(),
                func.avg(r.queue_s),
                func.avg(r.prefill_s),
                func.avg(r.decode_s),
                func.avg(decode_excl_swap),
                func.avg(r.swap_s),
                func.avg(r.e2e_s),
                func.sum(r.swaps),
                func.sum(r.preemptions),
            )
            .where(*conds)
            .group_by(bucket)
            .order_by(bucket)
        )
        rows = conn.execute(stmt).all()
    out = []
    for b, n, queue, prefill, decode, decode_excl, swap, e2e, swaps, preemptions in rows:
        queue, prefill, decode, e2e = float(queue), float(prefill), float(decode), float(e2e)
        decode_excl, swap = float(decode_excl), float(swap)
        out.append(
            StageBucket(
                ts=float(b),
                requests=int(n),
                queue_s=queue,
                prefill_s=prefill,
                first_token_gap_s=max(0.0, e2e - queue - prefill - decode_excl - swap),
                decode_excl_swap_s=decode_excl,
                swap_s=swap,
                decode_s=decode,
                e2e_s=e2e,
                swaps=int(swaps or 0),
                preemptions=int(preemptions or 0),
            )
        )
    return out


@dataclass(frozen=True)
class HistogramBin:
    lo: float
    hi: float
    count: int


def latency_histogram(
    db: Db,
    *,
    start: float,
    end: float,
    metric: LatencyMetric = "ttft",
    bins: int = 40,
    upper: float | None = None,
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    include_warmup: bool = False,
) -> list[HistogramBin]:
    """Equal-width bins from the smallest value to `upper` (default: the largest), counted in SQL.

    Values above `upper` land in the last bin, so the counts always add up to the requests in the window.
    """
    if bins < 1:
        raise ValueError("bins must be at least 1")
    column = _metric_column(metric)
    conds = [*_request_filter(start, end, instances, run_id, ("finished",), include_warmup), column.is_not(None)]
    with _bound(db) as conn:
        lo, hi = conn.execute(select(func.min(column), func.max(column)).where(*conds)).one()
        if lo is None:
            return []
        lo = float(lo)
        hi = float(hi) if upper is None else max(lo, min(float(upper), float(hi)))
        width = (hi - lo) / bins if hi > lo else 1.0
        index = _int_floor((column - literal(lo)) / literal(width), _dialect(conn))
        clamped = case((index >= bins, bins - 1), else_=index).label("i")
        counted = dict(conn.execute(select(clamped, func.count()).where(*conds).group_by(clamped)).all())
    n_bins = bins if hi > lo else 1
    return [HistogramBin(lo + i * width, lo + (i + 1) * width, int(counted.get(i, 0))) for i in range(n_bins)]


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
    """KV allocation trace downsampled: events, blocks and bytes per (bucket, op, tier)."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    a = AllocRow.__table__.c
    conds = _alloc_filter(start, end, instances, run_id)
    with _bound(db) as conn:
        bucket = bucket_expr(a.ts, bucket_s, _dialect(conn)).label("b")
        stmt = (
            select(bucket, a.op, a.tier, func.count(), func.sum(a.blocks), func.sum(a.bytes))
            .where(*conds)
            .group_by(bucket, a.op, a.tier)
            .order_by(bucket, a.op, a.tier)
        )
        rows = conn.execute(stmt).all()
    return [AllocOpBucket(float(b), op, tier, int(n), int(blk or 0), int(by or 0)) for b, op, tier, n, blk, by in rows]


def _alloc_filter(start: float, end: float, instances: Sequence[str] | None, run_id: str | None) -> list[ColumnElement]:
    a = AllocRow.__table__.c
    conds: list[ColumnElement] = [a.ts >= start, a.ts < end]
    if instances is not None:
        conds.append(a.instance.in_(instances))
    if run_id is not None:
        conds.append(a.run_id == run_id)
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
    """The newest `limit` allocation events of the window in time order, and how many the window holds."""
    t = AllocRow.__table__
    conds = _alloc_filter(start, end, instances, run_id)
    if ops is not None:
        conds.append(t.c.op.in_(ops))
    with _bound(db) as conn:
        total = int(conn.execute(select(func.count()).select_from(t).where(*conds)).scalar_one())
        stmt = select(t).where(*conds).order_by(t.c.ts.desc(), t.c.id.desc()).limit(max(0, int(limit)))
        events = [dict(row._mapping) for row in conn.execute(stmt)]
    events.reverse()
    return AllocTrace(total=total, events=events)


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
    conds: list[ColumnElement] = [s.ts >= start, s.ts < end, s.run_id == run_id]
    if instances is not None:
        conds.append(s.instance.in_(instances))
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
