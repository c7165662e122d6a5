"""Quantiles from cumulative histogram buckets: the one definition the read path and the rules share.

The semantics are Prometheus's `histogram_quantile` (promql/quantile.go): buckets are cumulative counts
by upper bound `le`; the quantile is interpolated linearly inside the bucket that holds rank q * count,
from the bucket's lower bound (0 for the first bucket when its upper bound is positive) to its upper
bound. The highest finite bound is the answer when the rank falls into the +Inf bucket. Counts that
decrease with `le` (a scrape that raced an observation) are made monotonic first, as Prometheus does.

A quantile from buckets is only as precise as the bucket layout: it lies within the width of the bucket
that holds the rank. Engines that push per-request events get exact percentiles instead
(collector.queries.request_stats).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def parse_le(value: str) -> float:
    """A bucket's `le` label as a float ("+Inf", "0.1", "1e-3"); ValueError when it is not a number."""
    return float(value)


def bucket_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile of cumulative `(upper_bound, count)` buckets; NaN without a +Inf bucket or observations."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    ordered = _monotonic(sorted(buckets))
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return math.nan
    observations = ordered[-1][1]
    if observations <= 0:
        return math.nan
    rank = q * observations
    index = next(i for i, (_, count) in enumerate(ordered) if count >= rank)
    if index == len(ordered) - 1:
        return ordered[-2][0]
    upper, count = ordered[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if index == 0 else ordered[index - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * ((rank - below) / in_bucket)


def _monotonic(buckets: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge equal bounds (summing is wrong: they are the same bucket twice) and clamp decreasing counts."""
    out: list[tuple[float, float]] = []
    for upper, count in buckets:
        if out and out[-1][0] == upper:
            out[-1] = (upper, max(out[-1][1], count))
            continue
        if out and count < out[-1][1]:
            count = out[-1][1]
        out.append((upper, count))
    return out
