"""The diagnosis page's reads: every trap checked on the selected instances (collector.queries.diagnose),
and the findings' series, requests and headline table as DataFrames."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine, to_time
from dashboard.tables import Col, Kind

STATUS_TEXT = {"present": "present", "absent": "not seen", "no_data": "not enough data"}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def findings(f: Filters) -> list[queries.Finding]:
    """One finding per (trap, instance): the selected instances, or every instance with data in the window."""
    return queries.diagnose(engine(f.db_url), start=f.start, end=f.end, instances=f.instance_list, run_id=f.run_id)


def cost_text(finding: queries.Finding) -> str:
    """The estimated cost of a present trap with its unit: `195.0 ms queue per burst arrival`, `12.3 prompt
    tokens/s recomputed`; '—' for a trap not present, `not estimated` where the data cannot give it."""
    value, unit = finding.cost_value, finding.cost_unit
    if not finding.present:
        return "—"
    if value is None:
        return "not estimated"
    if unit.startswith("s "):
        seconds = f"{value * 1e3:.1f} ms" if value < 1.0 else f"{value:.2f} s"
        return f"{seconds} {unit[2:]}"
    return f"{value:,.1f} {unit}"


def table(found: list[queries.Finding]) -> pd.DataFrame:
    """The headline table: trap, instance, status, cost and knob of every finding, present ones first."""
    order = {"present": 0, "no_data": 1, "absent": 2}
    rows = [
        {
            "trap": f.title,
            "instance": f.instance,
            "status": STATUS_TEXT[f.status],
            "severity": f.severity,
            "cost (estimated)": cost_text(f),
            "knob": f.knob,
            "_order": order[f.status],
        }
        for f in found
    ]
    df = pd.DataFrame(rows, columns=["trap", "instance", "status", "severity", "cost (estimated)", "knob", "_order"])
    return df.sort_values(["_order", "trap", "instance"], kind="stable").drop(columns="_order").reset_index(drop=True)


def series(finding: queries.Finding) -> pd.DataFrame:
    """The finding's evidence series in long format (series, ts, time, value)."""
    rows = [{"series": name, "ts": ts, "value": v} for name, points in finding.series.items() for ts, v in points]
    df = pd.DataFrame(rows, columns=["series", "ts", "value"])
    df["time"] = to_time(df["ts"])
    return df


FINDINGS_TABLE = {
    "trap": Col("Trap", width="medium"),
    "instance": Col("Instance"),
    "status": Col("Status"),
    "severity": Col("Severity"),
    "cost (estimated)": Col("Cost (estimated)", width="medium"),
    "knob": Col("Knob", width="medium"),
}


def request_columns(df: pd.DataFrame) -> dict[str, Col]:
    """Human headers for whatever request fields a detector kept: times as times, numbers as numbers."""

    def kind(column: str) -> Kind:
        if pd.api.types.is_datetime64_any_dtype(df[column]):
            return "time"
        return "number" if pd.api.types.is_numeric_dtype(df[column]) else "text"

    return {c: Col(c.replace("_", " ").capitalize(), kind(c)) for c in df.columns}


def requests(finding: queries.Finding) -> pd.DataFrame:
    """The requests that show the trap, with arrival and finish as times."""
    df = pd.DataFrame(finding.requests)
    for col, name in (("arrival", "arrived"), ("ts", "finished")):
        if col in df:
            df[name] = to_time(df.pop(col))
    first = [c for c in ("request_id", "arrived", "finished") if c in df]
    return df[first + [c for c in df.columns if c not in first]]
