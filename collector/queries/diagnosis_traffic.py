"""What the request checks measure by: the time with traffic, and what users waited.

A replayed trace or a quiet night leaves idle gaps in a window. An idle gap is not a baseline: counted in,
it pulls a median arrival rate to zero (every busy second then looks like a burst) and dilutes a share of
KV samples or a rate per second of the window. So the detectors measure over the spans with traffic only,
where an idle gap is IDLE_GAP_S or more without a request arriving (or in flight, for the KV checks).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from collector.queries.diagnosis_base import IDLE_GAP_S

Span = tuple[float, float]

# The request columns `waited_s` reads (request_rows selects them).
WAIT_COLUMNS: tuple[str, ...] = ("queue_s", "frontend_s")


def waited_s(row: Any) -> float:
    """What the user waited before their request ran: the one place the findings' queue time comes from.

    The engine's queue stage (`queue_s`) plus the time before the engine saw the request (`frontend_s`, the
    HTTP server's own stage: a vLLM's API server reading and rendering it); rows without that stage (not
    measured) count their queue alone.
    """
    return float(row.queue_s) + float(row.frontend_s or 0.0)


def spans(intervals: Iterable[Span]) -> list[Span]:
    """Disjoint spans covering `intervals`, bridging gaps shorter than IDLE_GAP_S (traffic, not idle time)."""
    out: list[Span] = []
    for lo, hi in sorted(intervals):
        if out and lo - out[-1][1] < IDLE_GAP_S:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, max(lo, hi)))
    return out


def arrival_spans(rows: Sequence[Any]) -> list[Span]:
    """Spans of arrivals: consecutive arrivals less than IDLE_GAP_S apart share one."""
    return spans((r.arrival, r.arrival) for r in rows)


def in_flight_spans(rows: Sequence[Any]) -> list[Span]:
    """Spans with a request arriving or in flight (arrival to finish)."""
    return spans((r.arrival, max(r.arrival, r.ts)) for r in rows)


def seconds_of(traffic: Sequence[Span]) -> list[int]:
    """The whole seconds (floor of epoch seconds) that the spans touch, in order."""
    out: set[int] = set()
    for lo, hi in traffic:
        out.update(range(math.floor(lo), math.floor(hi) + 1))
    return sorted(out)


def duration_s(traffic: Sequence[Span]) -> float:
    return sum(hi - lo for lo, hi in traffic)


def inside(traffic: Sequence[Span], points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (ts, value) points that fall in a span (`traffic` as `spans` returns it: sorted, disjoint)."""
    starts = [lo for lo, _ in traffic]
    out = []
    for ts, value in points:
        k = bisect.bisect_right(starts, ts) - 1
        if k >= 0 and ts <= traffic[k][1]:
            out.append((ts, value))
    return out
