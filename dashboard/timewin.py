"""Time windows: range presets, the resolved window the pages query, and the SQL bucket width for it.

Pure functions (no Streamlit), so the window logic is tested without a running app. Windows are half-open
`[start, end)` in epoch seconds, as collector.queries takes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

# Label -> seconds back from now. "Whole run" spans the selected run(s); "Custom" takes two datetimes.
RELATIVE_PRESETS: dict[str, float] = {
    "Last 15 minutes": 15 * 60.0,
    "Last hour": 3600.0,
    "Last 6 hours": 6 * 3600.0,
    "Last 24 hours": 86400.0,
    "Last 7 days": 7 * 86400.0,
}
WHOLE_RUN = "Whole run"
CUSTOM = "Custom"
PRESETS: tuple[str, ...] = (*RELATIVE_PRESETS, WHOLE_RUN, CUSTOM)

# Bucket widths a chart may use: round numbers a reader recognises on an axis.
NICE_BUCKETS_S: tuple[float, ...] = (
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
)
TARGET_POINTS = 300


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    label: str

    @property
    def span_s(self) -> float:
        return self.end - self.start

    def describe(self) -> str:
        return f"{fmt_ts(self.start)} → {fmt_ts(self.end)} UTC ({fmt_span(self.span_s)})"


def pick_bucket_s(span_s: float, target_points: int = TARGET_POINTS) -> float:
    """The smallest nice width giving at most `target_points` buckets: charts stay legible and cheap."""
    if span_s <= 0:
        return NICE_BUCKETS_S[0]
    wanted = span_s / target_points
    for width in NICE_BUCKETS_S:
        if width >= wanted:
            return float(width)
    return float(math.ceil(wanted / 86400.0) * 86400.0)


def default_preset(data_span: tuple[float, float] | None, now: float) -> str:
    """A range that fits the data: 'Whole run' when the data began less than an hour ago (a demo, a new
    engine) or ended more than an hour ago (a finished run); 'Last hour' for an engine serving for longer.

    A fixed hour around a two-minute run averages its rates over 58 idle minutes and draws it as a sliver.
    """
    if data_span is None:
        return "Last hour"
    first, last = data_span
    hour = RELATIVE_PRESETS["Last hour"]
    if now - last > hour or now - first < hour:
        return WHOLE_RUN
    return "Last hour"


def resolve(
    preset: str,
    *,
    now: float,
    run_span: tuple[float, float] | None,
    custom: tuple[float, float] | None = None,
) -> Window:
    """The concrete window of a preset. `run_span` is (first, last) of the selected data, for 'Whole run'."""
    if preset in RELATIVE_PRESETS:
        return Window(now - RELATIVE_PRESETS[preset], now, preset)
    if preset == WHOLE_RUN:
        if run_span is None:
            return Window(now - RELATIVE_PRESETS["Last hour"], now, "Last hour (no run data)")
        first, last = run_span
        # Pad by one second so the last event (ts < end) is inside the half-open window.
        return Window(math.floor(first), math.floor(last) + 1.0, WHOLE_RUN)
    if preset == CUSTOM:
        if custom is None or custom[1] <= custom[0]:
            raise ValueError("custom range needs an end after its start")
        return Window(custom[0], custom[1], CUSTOM)
    raise ValueError(f"unknown time range {preset!r}; choose one of {', '.join(PRESETS)}")


def fmt_ts(ts: float | None) -> str:
    if ts is None:
        return "—"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def fmt_span(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def fmt_ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    return f"{fmt_span(now - ts)} ago"
