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


PEAK_SERIES = {"kv_usage": "hot tier usage", "kv_cold_usage": "cold tier usage"}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def peaks(f: Filters, instances: tuple[str, ...]) -> dict[str, float]:
    """Series label -> the highest sample in the window over `instances` (the pushing engines).

    Without a run filter this is the raw maximum (SQL max over one window-wide bucket); with one, the
    highest of the run's bucket averages at chart resolution (the collector reads a run's samples as
    averages only), which is the raw maximum wherever a bucket holds one sample.
    """
    if not instances:
        return {}
    db = engine(f.db_url)
    out: dict[str, float] = {}
    if f.run_id is not None:
        by_name = queries.run_gauges_over_time(
            db,
            names=list(PEAK_SERIES),
            start=f.start,
            end=f.end,
            bucket_s=f.bucket_s,
            run_id=f.run_id,
            instances=list(instances),
        )
        for name, per_instance in by_name.items():
            values = [v for points in per_instance.values() for _, v in points]
            if values:
                out[PEAK_SERIES[name]] = max(values)
        return out
    span = max(f.end - f.start, 1.0)
    for name, label in PEAK_SERIES.items():
        found = queries.bucketed(
            db, name=name, start=f.start, end=f.end, bucket_s=span, instances=list(instances), agg="max"
        )
        values = [v for points in found.values() for _, v in points]
        if values:
            out[label] = max(values)
    return out
