"""KV memory from engine events: tier usage, waste and fragmentation samples, the allocation trace.

Scraped engines report KV usage as a gauge only (`dashboard.data.scraped`); waste, fragmentation and the
trace of allocations need kvpilot's engine push.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine, to_time

KV_SERIES = {
    "kv_usage": "hot tier usage",
    "cold_usage": "cold tier usage",
    "internal_waste": "internal waste",
    "fragmentation": "external fragmentation",
}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def usage(f: Filters) -> pd.DataFrame:
    """Bucket averages of the KV gauges engines sample (long format: instance, time, series, value)."""
    data = queries.kv_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    rows = [
        {"instance": inst, "ts": b.ts, "series": label, "value": getattr(b, key)}
        for inst, buckets in data.items()
        for b in buckets
        for key, label in KV_SERIES.items()
        if getattr(b, key) is not None
    ]
    df = pd.DataFrame(rows, columns=["instance", "ts", "series", "value"])
    df["time"] = to_time(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alloc_ops(f: Filters) -> pd.DataFrame:
    buckets = queries.alloc_ops_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bar_bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    df = pd.DataFrame([b.__dict__ for b in buckets], columns=["ts", "op", "tier", "events", "blocks", "bytes"])
    df["time"] = to_time(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alloc_trace(f: Filters, limit: int = 2000) -> tuple[int, pd.DataFrame]:
    """(events in the window, the newest `limit` of them) for the event-level timeline."""
    trace = queries.alloc_trace(
        engine(f.db_url), start=f.start, end=f.end, limit=limit, instances=f.instance_list, run_id=f.run_id
    )
    cols = ["ts", "instance", "run_id", "op", "tier", "request_id", "blocks", "block_size", "bytes", "usage_after"]
    df = pd.DataFrame(trace.events, columns=cols)
    df["time"] = to_time(df["ts"])
    return trace.total, df
