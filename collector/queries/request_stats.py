"""Request latency: the one request filter and the one percentile definition (exact nearest rank, in SQL).

For n values sorted ascending, the q-quantile is the k-th value with k = ceil(q * n) (k >= 1). It is computed
with ROW_NUMBER/COUNT window functions, which SQLite (>= 3.25) and PostgreSQL evaluate identically; the contract
tests check both against a Python reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, literal, select
from sqlalchemy.sql import ColumnElement

from collector.queries._base import (
    DEFAULT_QUANTILES,
    Db,
    GroupBy,
    LatencyMetric,
    _bound,
    _dialect,
    _f,
    _int_floor,
    bucket_expr,
)
from collector.schema import (
    RequestRow,
)

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
