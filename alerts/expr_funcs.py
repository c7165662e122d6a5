"""Functions and aggregations, as Prometheus computes them (promql/functions.go, aggregation in engine.go).

Range functions see one series' samples in [t - range, t]; `rate`/`increase` extrapolate as Prometheus's
extrapolatedRate does. `histogram_quantile` groups `_bucket` series by every label but `le` and leaves the
math to collector.histograms, the one definition the read path shares.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from alerts.expr_ast import Aggregate
from alerts.expr_values import NAME, EvalError, Labels, Points, Vector, drop_name
from collector.histograms import bucket_quantile, parse_le

RANGE_FUNCS = frozenset(
    {
        "rate",
        "irate",
        "increase",
        "delta",
        "avg_over_time",
        "max_over_time",
        "min_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
    }
)


def range_value(name: str, pts: Points, values: list[float], end: float, range_s: float) -> float | None:
    """The range function `name` over one series' samples in [end - range_s, end] (at least one)."""
    if name == "avg_over_time":
        return math.fsum(values) / len(values)
    if name == "max_over_time":
        return _nan_aware(max, values)
    if name == "min_over_time":
        return _nan_aware(min, values)
    if name == "sum_over_time":
        return math.fsum(values)
    if name == "count_over_time":
        return float(len(values))
    if name == "last_over_time":
        return values[-1]
    if name == "irate":
        if len(values) < 2:
            return None
        (t0, v0), (t1, v1) = pts[-2], pts[-1]
        delta = v1 - v0 if v1 >= v0 else v1
        return delta / (t1 - t0) if t1 > t0 else None
    return _extrapolated(pts, values, end - range_s, end, range_s, is_counter=name != "delta", is_rate=name == "rate")


def _extrapolated(
    pts: Points,
    values: list[float],
    range_start: float,
    range_end: float,
    range_s: float,
    *,
    is_counter: bool,
    is_rate: bool,
) -> float | None:
    if len(values) < 2:
        return None
    (first_t, first_v), (last_t, last_v) = pts[0], pts[-1]
    result = last_v - first_v
    if is_counter:
        previous = 0.0
        for value in values:
            if value < previous:
                result += previous
            previous = value
    to_start = first_t - range_start
    to_end = range_end - last_t
    sampled = last_t - first_t
    if sampled <= 0:
        return None
    average_step = sampled / (len(values) - 1)
    if is_counter and result > 0 and first_v >= 0:
        to_start = min(to_start, sampled * (first_v / result))
    threshold = average_step * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average_step / 2
    interval += to_end if to_end < threshold else average_step / 2
    result *= interval / sampled
    return result / range_s if is_rate else result


def quantile(q: float, values: Sequence[float]) -> float:
    if not values:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    weight = rank - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight


def histogram_quantile(q: float, vec: Vector) -> Vector:
    """Per label set but `le` (the name included, as Prometheus groups), the q-quantile of the buckets."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, value in vec.items():
        le = next((v for k, v in labels if k == "le"), None)
        if le is None:
            continue
        try:
            upper = parse_le(le)
        except ValueError:
            continue  # Prometheus skips a malformed bucket label
        groups.setdefault(tuple(p for p in labels if p[0] != "le"), []).append((upper, value))
    out = {drop_name(key): bucket_quantile(q, buckets) for key, buckets in groups.items()}
    return unique(out, len(groups), "histogram_quantile")


def aggregate(node: Aggregate, vec: Vector, param: float | None) -> Vector:
    """`by` keeps only the listed labels; `without` drops them and the name."""
    groups: dict[Labels, list[float]] = {}
    if node.without:
        dropped = {*node.grouping, NAME}
        for labels, value in vec.items():
            groups.setdefault(tuple(p for p in labels if p[0] not in dropped), []).append(value)
    else:
        kept = set(node.grouping)
        for labels, value in vec.items():
            groups.setdefault(tuple(p for p in labels if p[0] in kept), []).append(value)
    fn = AGGREGATORS[node.op]
    return {key: fn(values, param) for key, values in groups.items()}


def unique(out: Vector, expected: int, what: str) -> Vector:
    if len(out) != expected:
        raise EvalError(f"{what}: vector cannot contain metrics with the same labelset")
    return out


def _nan_aware(pick: Callable[..., float], values: Sequence[float]) -> float:
    """min/max as Prometheus: NaN only when every value is NaN."""
    if not math.isnan(sum(values)):
        return pick(values)
    numbers = [v for v in values if v == v]
    return pick(numbers) if numbers else math.nan


def _stdvar(values: list[float], _param: float | None) -> float:
    return statistics.pvariance(values) if len(values) > 1 else 0.0


ELEMENTWISE: dict[str, Callable[..., float]] = {
    "abs": abs,
    "ceil": lambda v: float(math.ceil(v)) if math.isfinite(v) else v,
    "floor": lambda v: float(math.floor(v)) if math.isfinite(v) else v,
    "clamp_min": lambda v, lo: max(v, lo) if not math.isnan(v) else v,
    "clamp_max": lambda v, hi: min(v, hi) if not math.isnan(v) else v,
    "clamp": lambda v, lo, hi: math.nan if lo > hi else (max(lo, min(hi, v)) if not math.isnan(v) else v),
}
AGGREGATORS: dict[str, Callable[[list[float], float | None], float]] = {
    "sum": lambda vs, _p: math.fsum(vs),
    "avg": lambda vs, _p: math.fsum(vs) / len(vs),
    "min": lambda vs, _p: _nan_aware(min, vs),
    "max": lambda vs, _p: _nan_aware(max, vs),
    "count": lambda vs, _p: float(len(vs)),
    "group": lambda vs, _p: 1.0,
    "stdvar": _stdvar,
    "stddev": lambda vs, p: math.sqrt(_stdvar(vs, p)),
    "quantile": lambda vs, p: quantile(p if p is not None else math.nan, vs),
}
