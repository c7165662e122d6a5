"""A fleet's latency percentiles over a long window from the per-minute latency sketch (`latency_sketches`).

Exact percentiles sort every request of the window: an hour of a 1,000-engine fleet is millions of them, and a
page reads eight stages. The sketch (`collector.latency_rollup`, PostgreSQL) keeps per minute and request
stage the finished, non-warm-up requests of every instance in logarithmic bins: bin i holds the values in
(GAMMA**(i-1), GAMMA**i] (values <= 0 in `ZERO_BIN`), each with its count, sum and largest value. Counts and
sums add and a maximum of maxima is the maximum, so any set of minutes has an exact count, mean and max, and
its nearest-rank q-quantile is read as the largest value of the bin that holds rank ceil(q * n): never below
the exact quantile and less than GAMMA (2%) above it. The sketch may show a server a little slower than its
requests were, never faster.

A window reads the sketch when it is fleet-wide (no instance or run filter: those read their few rows by
index), over the finished non-warm-up requests, longer than `ROLLUP_AFTER_S`, and bucketed (if at all) by
whole minutes; the minutes before the sketch's watermark come from it, whole (the window widened to whole
minutes, as the step rollup does), the rest from the raw rows, binned the same way in SQL and merged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Float, Integer, case, cast, func, literal, select, union_all
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from collector.queries._base import LatencyMetric, _dialect, bucket_expr
from collector.queries.step_rollup import ROLLUP_AFTER_S, ROLLUP_BUCKET_S
from collector.schema import LatencySketch, RequestRow, RollupWatermark

GAMMA = 1.02
LN_GAMMA = math.log(GAMMA)
MIN_BIN, MAX_BIN = -1200, 1200  # 2.5e-11 s .. 2e10 s: anything outside is clamped into the end bins
ZERO_BIN = MIN_BIN - 1  # values <= 0 (a stage that took no time)
WATERMARK = "latency"  # its row in rollup_watermarks
METRICS: tuple[LatencyMetric, ...] = ("ttft", "e2e", "frontend", "queue", "prefill", "decode", "swap", "tpot")
SKETCH_NOTE = "whole minutes from the per-minute latency sketch: quantiles at most 2% above the exact"


def bin_of(value: float) -> int:
    """The bin of one value, as `bin_expr` computes it in SQL."""
    if value <= 0:
        return ZERO_BIN
    return max(MIN_BIN, min(MAX_BIN, math.ceil(math.log(value) / LN_GAMMA)))


def bin_expr(value: ColumnElement, dialect: str) -> ColumnElement:
    """The bin of `value` in SQL (`bin_of`)."""
    raw = func.ceil(func.ln(value) / literal(LN_GAMMA))
    clamp = (func.max, func.min) if dialect == "sqlite" else (func.greatest, func.least)  # SQLite's are scalar
    index = cast(clamp[0](literal(MIN_BIN), clamp[1](literal(MAX_BIN), raw)), Integer)
    return case((value <= 0, literal(ZERO_BIN)), else_=index)


@dataclass(frozen=True)
class SketchWindow:
    lo: float  # the first minute read from the sketch, whole
    through: float  # the sketch's watermark: minutes from here on are raw
    end: float


def sketch_window(
    conn: Session | Connection,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    statuses: Sequence[str] | None,
    include_warmup: bool,
    bucket_s: float | None = None,
    watermark: str = WATERMARK,
) -> SketchWindow | None:
    """The part of the window the sketch serves (module docstring), None when the window reads raw rows;
    `watermark` names another fleet-wide per-minute rollup of the same requests (the stage sums')."""
    if instances is not None or run_id is not None or include_warmup or tuple(statuses or ()) != ("finished",):
        return None
    if end - start <= ROLLUP_AFTER_S or (bucket_s is not None and bucket_s % ROLLUP_BUCKET_S):
        return None
    w = RollupWatermark.__table__.c
    through = conn.execute(select(w.through_ts).where(w.name == watermark)).scalar_one_or_none()
    lo = math.floor(start / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S
    if through is None or through <= lo:
        return None
    return SketchWindow(lo, float(through), end)


def bin_rows(
    conn: Session | Connection,
    window: SketchWindow,
    metric: LatencyMetric,
    value: ColumnElement,
    conds: Sequence[ColumnElement],
    bucket_s: float | None = None,
) -> list[tuple[float, int, int, float, float]]:
    """(bucket or 0, bin, count, sum, max) of `metric` over the window, the sketch's minutes merged with the
    raw rows after them (`conds` filter those), ordered by bucket and bin."""
    s = LatencySketch.__table__.c
    r = RequestRow.__table__.c
    dialect = _dialect(conn)
    zero = cast(literal(0.0), Float)
    sk_bucket = bucket_expr(s.bucket_ts, bucket_s, dialect) if bucket_s else zero
    raw_bucket = bucket_expr(r.ts, bucket_s, dialect) if bucket_s else zero
    upto = min(window.through, window.end)
    sketched = select(sk_bucket.label("b"), s.bin.label("bin"), s.count.label("n"), s.total, s.peak).where(
        s.metric == metric, s.bucket_ts >= window.lo, s.bucket_ts < upto
    )
    binned = bin_expr(value, dialect)
    raw = (
        select(raw_bucket.label("b"), binned.label("bin"), func.count(value), func.sum(value), func.max(value))
        .where(*conds, r.ts >= window.through, value.is_not(None))
        .group_by(raw_bucket, binned)
    )
    both = union_all(sketched, raw).subquery("bins")
    stmt = (
        select(both.c.b, both.c.bin, func.sum(both.c.n), func.sum(both.c.total), func.max(both.c.peak))
        .group_by(both.c.b, both.c.bin)
        .order_by(both.c.b, both.c.bin)
    )
    return [(float(b), int(i), int(n), float(t), float(p)) for b, i, n, t, p in conn.execute(stmt)]


def value_count(
    conn: Session | Connection,
    window: SketchWindow,
    metric: LatencyMetric,
    value: ColumnElement,
    conds: Sequence[ColumnElement],
) -> int:
    """How many requests of the window have a value of `metric` (the sketch's counts and the raw rows after
    them): a count, no bins."""
    s = LatencySketch.__table__.c
    r = RequestRow.__table__.c
    sketched = select(func.coalesce(func.sum(s.count), 0)).where(
        s.metric == metric, s.bucket_ts >= window.lo, s.bucket_ts < min(window.through, window.end)
    )
    raw = select(func.count(value)).where(*conds, r.ts >= window.through)
    return int(conn.execute(select(sketched.scalar_subquery() + raw.scalar_subquery())).scalar_one())


@dataclass(frozen=True)
class Merged:
    count: int
    mean: float | None
    max: float | None
    quantiles: dict[float, float | None]


def merge(bins: Sequence[tuple[int, int, float, float]], quantiles: Sequence[float]) -> Merged:
    """Count, mean, max and nearest-rank quantiles of bins (bin, count, sum, max) in ascending bin order: the
    q-quantile is the largest value of the bin holding rank ceil(q * n) (rank 1 at least)."""
    n = sum(c for _, c, _, _ in bins)
    if n == 0:
        return Merged(0, None, None, {float(q): None for q in quantiles})
    ranks = sorted((max(1, math.ceil(q * n)), float(q)) for q in quantiles)  # as `request_stats._nearest_rank`
    out: dict[float, float | None] = {}
    seen, k = 0, 0
    for _, c, _, peak in bins:
        seen += c
        while k < len(ranks) and ranks[k][0] <= seen:
            out[ranks[k][1]] = peak
            k += 1
    return Merged(n, sum(t for _, _, t, _ in bins) / n, max(p for _, _, _, p in bins), out)
