"""Request latency: the one request filter and the one percentile definition (exact nearest rank, in SQL).

TTFT and e2e are the user-facing figures: from the request's arrival at the server's HTTP layer, i.e. the
engine's own `ttft_s`/`e2e_s` plus `frontend_s`, the stage before the engine (`user_ttft`, `user_e2e`).
Where `frontend_s` was not measured (NULL) they are the engine's view; `headline_latency` says so.

For n values sorted ascending, the q-quantile is the k-th value with k = ceil(q * n) (k >= 1). PostgreSQL
computes it with `percentile_disc(q) WITHIN GROUP (ORDER BY v)`, whose definition this is (the first value whose
position in the ordering reaches the fraction q; one sort per group, shared by the quantiles); SQLite has no
ordered-set aggregates and ranks with ROW_NUMBER/COUNT window functions (>= 3.25). The contract tests check both
against a Python reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, literal, select
from sqlalchemy.sql import ColumnElement
from sqlalchemy.sql.elements import BindParameter

from collector.queries import latency_sketch as sketch
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
    scope,
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


def user_ttft() -> ColumnElement:
    """Time to first token as the user waited it: the stage before the engine, then the engine's TTFT."""
    r = RequestRow.__table__.c
    return r.ttft_s + func.coalesce(r.frontend_s, 0.0)


def user_e2e() -> ColumnElement:
    """End to end as the user waited it (from the HTTP arrival)."""
    r = RequestRow.__table__.c
    return r.e2e_s + func.coalesce(r.frontend_s, 0.0)


def metric_column(metric: LatencyMetric) -> ColumnElement:
    r = RequestRow.__table__.c
    columns: dict[str, ColumnElement] = {
        "ttft": user_ttft(),
        "e2e": user_e2e(),
        "frontend": r.frontend_s,
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
    conds = scope(RequestRow.__table__, start, end, instances, run_id)
    if statuses is not None:
        conds.append(r.status.in_(statuses))
    if not include_warmup:
        conds.append(r.warmup.is_(False))
    return conds


def _check_quantiles(quantiles: Sequence[float]) -> None:
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles must be within [0, 1], got {q}")


def _nearest_rank(
    conn: Any, value: ColumnElement, keys: Sequence[ColumnElement], conds: Sequence[ColumnElement], quantiles
) -> list[Any]:
    """Rows (*keys, count, mean, max, *quantiles) of `value` per distinct keys: THE percentile definition.

    Nearest rank: the q-quantile is the smallest rank k with k >= q * n (k = ceil(q * n), rank 1 when
    q * n <= 1): PostgreSQL's `percentile_disc`, elsewhere ROW_NUMBER/COUNT windows partitioned by the keys.
    The window form sorts every row, numbers it and aggregates again: on PostgreSQL it read a fleet's hour of
    requests several times slower than the ordered-set aggregate.
    """
    labelled = [k.label(f"k{i}") for i, k in enumerate(keys)]
    if _dialect(conn) == "postgresql":
        ordered = [func.percentile_disc(literal(float(q))).within_group(value) for q in quantiles]
        stmt = select(*labelled, func.count(value), func.avg(value), func.max(value), *ordered)
        stmt = stmt.where(*conds, value.is_not(None))
        # a constant key (group_by "all") is no GROUP BY term; with none left, no rows is no group, as ranked
        grouped = [k for k, key in zip(labelled, keys, strict=True) if not isinstance(key, BindParameter)]
        stmt = stmt.group_by(*grouped).order_by(*grouped) if grouped else stmt.having(func.count(value) > 0)
        return conn.execute(stmt).all()
    ranked = (
        select(
            *labelled,
            value.label("v"),
            func.row_number().over(partition_by=labelled, order_by=value).label("rn"),
            func.count().over(partition_by=labelled).label("n"),
        )
        .where(*conds, value.is_not(None))
        .subquery()
    )
    key_cols = [ranked.c[f"k{i}"] for i in range(len(keys))]
    cols: list[Any] = [*key_cols, func.count(), func.avg(ranked.c.v), func.max(ranked.c.v)]
    for q in quantiles:
        cols.append(func.min(case((ranked.c.rn >= literal(float(q)) * ranked.c.n, ranked.c.v), else_=None)))
    return conn.execute(select(*cols).group_by(*key_cols).order_by(*key_cols)).all()


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
    """Exact nearest-rank quantiles of a request stage (ttft, e2e, frontend, queue, prefill, decode, swap, tpot).

    `ttft` and `e2e` are user-facing (from the HTTP arrival); `frontend` is the stage before the engine;
    `swap` is the time swapped out to the host tier, which also counts inside prefill or decode.
    """
    _check_quantiles(quantiles)
    conds = _request_filter(start, end, instances, run_id, statuses, include_warmup)
    with _bound(db) as conn:
        if group_by == "all":
            window = sketch.sketch_window(
                conn,
                start=start,
                end=end,
                instances=instances,
                run_id=run_id,
                statuses=statuses,
                include_warmup=include_warmup,
            )
            if window is not None:
                stats = sketched_stats(conn, window, metric, conds, quantiles)
                return [stats] if stats.count else []
        rows = _nearest_rank(conn, metric_column(metric), [_group_column(group_by)], conds, quantiles)
    return [
        LatencyStats(
            group=str(row[0]),
            count=int(row[1]),
            mean=_f(row[2]),
            max=_f(row[3]),
            quantiles={float(q): _f(v) for q, v in zip(quantiles, row[4:], strict=True)},
        )
        for row in rows
    ]


def sketched_stats(
    conn: Any,
    window: sketch.SketchWindow,
    metric: LatencyMetric,
    conds: Sequence[ColumnElement],
    quantiles: Sequence[float],
) -> LatencyStats:
    """A fleet-wide stage's figures over a window the latency sketch serves (`latency_sketch`)."""
    bins = sketch.bin_rows(conn, window, metric, metric_column(metric), conds)
    m = sketch.merge([row[1:] for row in bins], quantiles)
    return LatencyStats(group="all", count=m.count, mean=m.mean, max=m.max, quantiles=m.quantiles)


@dataclass(frozen=True)
class QuantileBucket:
    ts: float
    count: int
    mean: float
    quantiles: dict[float, float | None]
    group: str = "all"


def latency_quantiles_over_time(
    db: Db,
    *,
    start: float,
    end: float,
    bucket_s: float,
    metric: LatencyMetric = "ttft",
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    group_by: GroupBy = "all",
    instances: Sequence[str] | None = None,
    run_id: str | None = None,
    statuses: Sequence[str] | None = ("finished",),
    include_warmup: bool = False,
) -> list[QuantileBucket]:
    """Exact nearest-rank quantiles of a request stage per (group, time bucket), as `latency_percentiles`.

    The dashboard's "TTFT p99" chart and the TTFTRegression rule's `ttft_p99_seconds` both come from here.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be positive")
    _check_quantiles(quantiles)
    r = RequestRow.__table__.c
    conds = _request_filter(start, end, instances, run_id, statuses, include_warmup)
    with _bound(db) as conn:
        if group_by == "all":
            window = sketch.sketch_window(
                conn,
                start=start,
                end=end,
                instances=instances,
                run_id=run_id,
                statuses=statuses,
                include_warmup=include_warmup,
                bucket_s=bucket_s,
            )
            if window is not None:
                return _sketched_buckets(conn, window, metric, conds, quantiles, bucket_s)
        keys = [_group_column(group_by), bucket_expr(r.ts, bucket_s, _dialect(conn))]
        rows = _nearest_rank(conn, metric_column(metric), keys, conds, quantiles)
    return [
        QuantileBucket(
            ts=float(row[1]),
            count=int(row[2]),
            mean=float(row[3]),
            quantiles={float(q): _f(v) for q, v in zip(quantiles, row[5:], strict=True)},
            group=str(row[0]),
        )
        for row in rows
    ]


def _sketched_buckets(
    conn: Any,
    window: sketch.SketchWindow,
    metric: LatencyMetric,
    conds: Sequence[ColumnElement],
    quantiles: Sequence[float],
    bucket_s: float,
) -> list[QuantileBucket]:
    by_bucket: dict[float, list[tuple[int, int, float, float]]] = {}
    for ts, *rest in sketch.bin_rows(conn, window, metric, metric_column(metric), conds, bucket_s):
        by_bucket.setdefault(ts, []).append(tuple(rest))  # type: ignore[arg-type]  # (bin, count, sum, max)
    out = []
    for ts, bins in by_bucket.items():
        m = sketch.merge(bins, quantiles)
        out.append(QuantileBucket(ts=ts, count=m.count, mean=m.mean or 0.0, quantiles=m.quantiles))
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
    column = metric_column(metric)
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
        counted: dict[int, int] = dict(
            conn.execute(select(clamped, func.count()).where(*conds).group_by(clamped)).all()
        )
    n_bins = bins if hi > lo else 1
    return [HistogramBin(lo + i * width, lo + (i + 1) * width, int(counted.get(i, 0))) for i in range(n_bins)]
