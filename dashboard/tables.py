"""Tables as a reader scans them: human headers, units and sensible precision, empty cells for missing values.

Every `st.dataframe` of the dashboard goes through `show` with a `Col` per column it displays. The data
keep their raw values (seconds as floats, timestamps as datetimes), so sorting and tests see numbers;
what a reader sees is formatted: latencies in µs/ms/s, counts with thousands separators and no ".0",
fractions as percentages, times in UTC as `YYYY-MM-DD HH:MM:SS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd
import streamlit as st

from dashboard.timewin import fmt_span

Kind = Literal["text", "count", "seconds", "number", "percent", "bar", "time", "clock", "bytes", "gib", "link", "bool"]
Width = Literal["small", "medium", "large"] | int | None


@dataclass(frozen=True)
class Col:
    label: str
    kind: Kind = "text"
    unit: str = ""  # after a "number": "req/s", "tok/s", "W"
    sig: int = 3  # significant digits of a "number" (1,208 · 7.48 · 0.102)
    width: Width = None
    help: str | None = None


def fmt_seconds(value: Any) -> str:
    """850 µs, 42.1 ms, 1.27 s, 14 min: one unit per value, three significant figures."""
    if _missing(value):
        return ""
    seconds = float(value)
    if seconds == 0:
        return "0 s"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if abs(seconds) < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    if abs(seconds) < 120:
        return f"{seconds:.3g} s"
    return fmt_span(seconds)


def fmt_number(value: Any, unit: str = "", sig: int = 3) -> str:
    """`sig` significant digits, never fewer than the integer part, thousands separated, no trailing zeros."""
    if _missing(value):
        return ""
    number = float(value)
    decimals = 0 if number == 0 else max(0, min(6, sig - 1 - math.floor(math.log10(abs(number)))))
    text = f"{number:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}".rstrip()


def fmt_bytes(value: Any) -> str:
    if _missing(value):
        return ""
    n = float(value)
    for limit, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= limit:
            return f"{n / limit:.1f} {suffix}"
    return f"{n:.0f} B"


def _missing(value: Any) -> bool:
    if value is None or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def fmt_text(value: Any) -> str:
    """A text column's cell: numbers without trailing zeros (a parameter's 0.65, not 0.650000)."""
    if _missing(value):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _formatter(col: Col) -> Callable[[Any], str] | None:
    """Display text for the kinds Streamlit's own column formats cannot express (a unit per value)."""
    if col.kind == "text":
        return fmt_text
    if col.kind == "seconds":
        return fmt_seconds
    if col.kind == "number":
        return lambda v: fmt_number(v, col.unit, col.sig)
    if col.kind == "bytes":
        return fmt_bytes
    if col.kind == "gib":
        return lambda v: "" if _missing(v) else f"{float(v):,.1f} GiB"
    return None


def _config(col: Col) -> Any:
    common = {"help": col.help, "width": col.width}
    match col.kind:
        case "count":
            return st.column_config.NumberColumn(col.label, format="localized", **common)
        case "percent":
            return st.column_config.NumberColumn(col.label, format="percent", **common)
        case "bar":
            return st.column_config.ProgressColumn(col.label, min_value=0.0, max_value=1.0, format="percent", **common)
        case "time":
            return st.column_config.DatetimeColumn(col.label, format="YYYY-MM-DD HH:mm:ss", **common)
        case "clock":
            return st.column_config.DatetimeColumn(col.label, format="HH:mm:ss.SSS", **common)
        case "link":
            return st.column_config.LinkColumn(col.label, **common)
        case "bool":
            return st.column_config.CheckboxColumn(col.label, **common)
        case "text":
            return st.column_config.TextColumn(col.label, **common)
        case _:
            return st.column_config.Column(col.label, **common)


def _empty(series: pd.Series) -> bool:
    return bool(series.map(lambda v: _missing(v) or v == "").all())


def show(
    df: pd.DataFrame,
    columns: Mapping[str, Col],
    *,
    height: int | Literal["auto"] = "auto",
    keep_empty: bool = False,
) -> None:
    """The columns named in `columns`, in that order, formatted; other columns of `df` stay hidden, and so
    do columns with nothing in them (unless `keep_empty`), so the ones that matter fit the page."""
    shown = [c for c in columns if c in df.columns and (keep_empty or df.empty or not _empty(df[c]))]
    data = df[shown].reset_index(drop=True)  # hidden columns never reach the browser
    formats = {c: f for c in shown if (f := _formatter(columns[c])) is not None}
    for c in shown:
        if columns[c].kind in ("time", "clock") and not pd.api.types.is_datetime64_any_dtype(data[c]):
            data[c] = pd.to_datetime(data[c], unit="s", utc=True)
    body: Any = data.style.format(formats, na_rep="") if formats else data
    st.dataframe(
        body,
        hide_index=True,
        width="stretch",
        height=height,
        column_config={c: _config(columns[c]) for c in shown},
        placeholder="",
    )


# Tables that more than one page shows: the scraped label sets (dashboard.data.scraped.label_sets).
SCRAPED_ENGINE_TABLE = {
    "instance": Col("Instance", width=150),
    "labels": Col("Labels", width="medium"),
    "queue depth": Col("Queued", "number"),
    "running": Col("Running", "number"),
    "swapped": Col("Swapped", "number"),
    "KV usage": Col("KV now", "bar", width=110),
    "KV peak": Col(
        "KV, highest sample", "bar", width=110, help="the highest sample in the window: sampled, not a peak"
    ),
    "cold KV usage": Col("Cold KV now", "bar", width=110),
    "prefix hit rate": Col("Prefix hits", "bar", width=110),
    "preemptions": Col("Preemptions", "count", help="counter increase in the window"),
    "newest": Col("Newest", "time"),
}
GPU_TABLE = {
    "instance": Col("Instance", width=150),
    "labels": Col("Labels", width="medium"),
    "utilization": Col("Busy now", "bar", width=110),
    "memory": Col("Memory now", "bar", width=110),
    "memory peak": Col(
        "Memory, highest sample", "bar", width=110, help="the highest sample in the window: sampled, not a peak"
    ),
    "memory used (GiB)": Col("Used", "gib"),
    "memory total (GiB)": Col("Total", "gib"),
    "power (W)": Col("Power", "number", unit="W"),
    "temperature (°C)": Col("Temperature", "number", unit="°C"),
    "newest": Col("Newest", "time"),
}
