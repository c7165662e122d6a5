"""Shared page furniture: the current filters, error and empty states that say what to do, number formats."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import streamlit as st

from collector.errors import CollectorError, StorageUnavailableError
from dashboard.data import DataUnavailable, Filters
from dashboard.timewin import fmt_span

FILTERS_KEY = "kvpilot_filters"
WINDOW_KEY = "kvpilot_window_text"
LIVE_KEY = "kvpilot_window_live"  # the window reaches the present (not a custom range in the past)


def current_filters() -> Filters:
    """The filters app.py resolved from the sidebar for this run."""
    filters = st.session_state.get(FILTERS_KEY)
    if filters is None:
        st.error("Open this page through the dashboard (`kvpilot dashboard`): its filters are not set.")
        st.stop()
    return filters


def window_text() -> str:
    return st.session_state.get(WINDOW_KEY, "the selected time range")


def follows_present() -> bool:
    """Whether the selected window is meant to reach now (a preset or 'Whole run', not a custom range)."""
    return bool(st.session_state.get(LIVE_KEY, True))


def page_caption(text: str) -> None:
    """The line under a page's title; it also says, once per page, how times read."""
    st.caption(f"{text} All times are UTC, 24-hour.")


def empty(what: str, hint: str) -> None:
    """An empty state: what is missing in which window, and the next step to get it."""
    st.info(f"**No {what}** in {window_text()}. {hint}", icon=":material/info:")


PUSH_SOURCE = "kvpilot's engine push (`telemetry.sink: http`, `telemetry.collector_url`)"
TRACE_SOURCE = "vLLM's OpenTelemetry traces (`vllm serve --otlp-traces-endpoint` pointed at the collector)"


def needs_events(figures: str, instances: Sequence[str], sources: Sequence[str] = (PUSH_SOURCE, TRACE_SOURCE)) -> None:
    """In place of an empty chart: these figures need per-request events, which a scrape does not carry."""
    names = ", ".join(f"`{n}`" for n in instances)
    verb = "is" if len(instances) == 1 else "are"
    st.info(
        f"**{figures} need per-request events**; {names} {verb} only scraped (a /metrics scrape gives counters, "
        f"gauges and histogram buckets). They come from {' or '.join(sources)}.",
        icon=":material/info:",
    )


@contextlib.contextmanager
def guarded(section: str) -> Iterator[None]:
    """Render a section, turning data errors into a message with the fix instead of a traceback."""
    try:
        yield
    except DataUnavailable as exc:
        st.info(f"**{section}:** {exc}", icon=":material/info:")
    except StorageUnavailableError as exc:
        st.error(
            f"**{section}:** the database is unreachable ({exc}). Check that it is up and that "
            "KVPILOT_DB_URL points at it.",
            icon=":material/error:",
        )
    except CollectorError as exc:
        st.error(f"**{section}:** {exc}. If the schema is behind, run `kvpilot db upgrade`.", icon=":material/error:")


def fmt_s(seconds: float | None) -> str:
    """Latency with a unit a reader can compare at a glance: 850 µs, 42.1 ms, 1.27 s."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return fmt_span(seconds)


def fmt_pct(fraction: float | None) -> str:
    if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)):
        return "—"
    return f"{fraction * 100:.1f}%"


def fmt_num(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.2f}{suffix}{unit}"
    text = f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)
    return f"{text}{unit}"
