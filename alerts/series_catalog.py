"""Which series names rule expressions may use: collector's canonical names plus alerts' derived ones.

`ttft_p99_seconds` is not a stored series: the collector keeps TTFT histograms only as _sum/_count, so
the SQL source computes the p99 per minute from per-request events (alerts.sql_source).
"""

from __future__ import annotations

from collector.series import CANONICAL

DERIVED_SERIES: dict[str, str] = {
    "ttft_p99_seconds": "p99 of time to first token over the requests finished in each minute",
}


def known_series() -> frozenset[str]:
    return frozenset(CANONICAL) | frozenset(DERIVED_SERIES)


def series_kind(name: str) -> str:
    """'gauge' or 'counter' (derived series are gauges)."""
    canonical = CANONICAL.get(name)
    return canonical.kind if canonical is not None else "gauge"
