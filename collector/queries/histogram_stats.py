"""Percentiles of scraped histograms over any window (vLLM, SGLang, kvpilot's /metrics): `histogram_quantile`.

A scraped histogram is stored as cumulative counters `<base>_bucket{le=...}`, `<base>_sum`, `<base>_count`,
one set per label set. The quantile over a window [start, end) comes from each bucket's increase over the
window — counted from the last scrape before `start` (up to `lookback_s` before it), so observations
between that scrape and the first one inside the window are not lost, and with counter resets handled as
in `increase()` — summed over the series that share the `by` labels, then interpolated inside the bucket
(collector.histograms, the same math as the rules). A bucket quantile is precise to its bucket's width;
engines that push per-request events get exact percentiles from `request_stats` instead.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from collector.histograms import bucket_quantile, parse_le
from collector.queries._base import DEFAULT_QUANTILES, Db
from collector.queries.timeseries import SeriesId, group_key, raw_series
from collector.series import CANONICAL


@dataclass(frozen=True)
class HistogramQuantiles:
    ts: float
    count: float
    mean: float | None
    quantiles: dict[float, float | None]


def histogram_bases() -> list[str]:
    """The canonical histograms (bases with `_count`), e.g. ttft_seconds, itl_seconds, e2e_seconds."""
    return sorted(n.removesuffix("_count") for n in CANONICAL if n.endswith("_count"))


def histogram_quantiles(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    instances: Sequence[str] | None = None,
    by: Sequence[str] = ("instance",),
    lookback_s: float = 300.0,
) -> dict[SeriesId, HistogramQuantiles]:
    """Group (the `by` labels of the series) -> observations, mean and quantiles over [start, end)."""
    over_time = histogram_quantiles_over_time(
        db,
        name=name,
        start=start,
        end=end,
        bucket_s=end - start,
        quantiles=quantiles,
        instances=instances,
        by=by,
        lookback_s=lookback_s,
    )
    return {group: points[0] for group, points in over_time.items() if points}


def histogram_quantiles_over_time(
    db: Db,
    *,
    name: str,
    start: float,
    end: float,
    bucket_s: float,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    instances: Sequence[str] | None = None,
    by: Sequence[str] = ("instance",),
    lookback_s: float = 300.0,
) -> dict[SeriesId, list[HistogramQuantiles]]:
    """Group -> one HistogramQuantiles per window [start + k*bucket_s, ...) that saw observations."""
    if f"{name}_count" not in CANONICAL:
        raise ValueError(f"unknown histogram {name!r}; known: {', '.join(histogram_bases())}")
    if bucket_s <= 0 or end <= start:
        raise ValueError("bucket_s must be positive and end after start")
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantiles must be within [0, 1], got {q}")
    fetch_from = start - lookback_s
    buckets = raw_series(db, name=f"{name}_bucket", start=fetch_from, end=end, instances=instances)
    sums = raw_series(db, name=f"{name}_sum", start=fetch_from, end=end, instances=instances)
    counts = raw_series(db, name=f"{name}_count", start=fetch_from, end=end, instances=instances)
    # A restart resets every counter of the histogram, but a counter that grows past its old value by the
    # next scrape hides it (a _sum often does): the histogram's resets are read off its _count.
    resets = {sid: _drops(points) for sid, points in counts.items()}
    edges = [start + k * bucket_s for k in range(math.ceil((end - start) / bucket_s - 1e-9))] + [end]
    out: dict[SeriesId, list[HistogramQuantiles]] = {}
    for lo, hi in itertools.pairwise(edges):
        per_group: dict[SeriesId, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        sum_by_group: dict[SeriesId, float] = defaultdict(float)
        for sid, points in buckets.items():
            le = sid.label_dict().get("le")
            if le is None:
                continue
            try:
                upper = parse_le(le)
            except ValueError:
                continue
            without_le = SeriesId(sid.instance, tuple(p for p in sid.labels if p[0] != "le"))
            per_group[group_key(without_le, by)][upper] += _window_increase(points, lo, hi, resets.get(without_le))
        for sid, points in sums.items():
            sum_by_group[group_key(sid, by)] += _window_increase(points, lo, hi, resets.get(sid))
        for group, by_upper in per_group.items():
            count = by_upper.get(math.inf, 0.0)
            if count <= 0:
                continue
            layout = sorted(by_upper.items())
            values = {float(q): _finite(bucket_quantile(q, layout)) for q in quantiles}
            mean = sum_by_group[group] / count if group in sum_by_group else None
            out.setdefault(group, []).append(HistogramQuantiles(lo, count, mean, values))
    return out


def _drops(points: list[tuple[float, float]]) -> frozenset[float]:
    """Timestamps at which a counter went down: where the histogram's process restarted."""
    return frozenset(t1 for (_, v0), (t1, v1) in itertools.pairwise(points) if v1 < v0)


def _window_increase(points: list[tuple[float, float]], lo: float, hi: float, resets: frozenset[float] | None) -> float:
    """Increase of a counter over [lo, hi), from the last point before lo when there is one."""
    times = [t for t, _ in points]
    first = bisect.bisect_left(times, lo)
    last = bisect.bisect_left(times, hi)
    window = points[max(0, first - 1) : last]
    resets = resets or frozenset()
    total = 0.0
    for (_, prev), (t, cur) in itertools.pairwise(window):
        total += cur if (t in resets or cur < prev) else cur - prev
    return total


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value
