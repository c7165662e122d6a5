"""What a scrape gives for an instance, one row per label set: a vLLM engine, a GPU of a DCGM exporter.

Gauges are shown per label set and never averaged across them; where one number per instance is needed,
counts (queue, running) add up and fractions (KV, memory, utilization) take the fullest label set, as a
`> threshold` rule would see it. Latency percentiles come from the scraped histogram buckets
(`histogram_quantile`), precise to a bucket's width; exact ones need per-request events.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pandas as pd
import streamlit as st

from collector import queries
from collector.queries import SeriesId
from dashboard.data.base import TTL_S, Filters, engine, label_text, to_time
from dashboard.data.catalog import selection

ENGINE_GAUGES = {
    "queue_depth": "queue depth",
    "running": "running",
    "swapped": "swapped",
    "kv_usage": "KV usage",
    "kv_cold_usage": "cold KV usage",
    "prefix_hit_rate": "prefix hit rate",
}
GPU_GAUGES = {
    "utilization": "utilization",
    "memory_usage": "memory",
    "memory_used_bytes": "memory used (GiB)",
    "memory_total_bytes": "memory total (GiB)",
    "gpu_power_watts": "power (W)",
    "gpu_temperature_celsius": "temperature (°C)",
}
# The highest value in the window, next to the newest: what a `> threshold` rule on the series sees.
PEAKS = {"kv_usage": "KV peak", "memory_usage": "memory peak"}
HISTOGRAMS = {"ttft_seconds": "TTFT", "itl_seconds": "ITL", "e2e_seconds": "End to end", "queue_time_seconds": "Queue"}
HISTOGRAM_QUANTILES = (0.5, 0.9, 0.99)
GIB = 2**30
FAILED = {("status", "failed"), ("status", "rejected"), ("status", "aborted"), ("finished_reason", "abort")}


def newest(db: Any, name: str, f: Filters, instances: Sequence[str]) -> dict[SeriesId, tuple[float, float]]:
    """SeriesId -> (ts, value) of its newest point in the window.

    Read from the window's last tenth first (24 of its chart buckets), so a week-long window does not
    fetch a week of points; the whole window only when nothing was scraped in that tail.
    """
    tail = max(f.start, f.end - 24 * f.bucket_s)
    points = queries.series_points(db, name=name, start=tail, end=f.end, instances=instances)
    if not points and tail > f.start:
        points = queries.series_points(db, name=name, start=f.start, end=f.end, instances=instances)
    return {sid: pts[-1] for sid, pts in points.items() if pts}


def peak(db: Any, name: str, f: Filters, instances: Sequence[str]) -> dict[SeriesId, float]:
    """SeriesId -> its highest value in the window (max in SQL)."""
    span = max(f.end - f.start, 1.0)
    buckets = queries.bucketed(db, name=name, start=f.start, end=f.end, bucket_s=span, instances=instances, agg="max")
    return {sid: max(v for _, v in pts) for sid, pts in buckets.items() if pts}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def label_sets(f: Filters, kind: str) -> pd.DataFrame:
    """One row per scraped label set of the selection: `engine` gauges (with preemptions) or `gpu` gauges."""
    gauges = ENGINE_GAUGES if kind == "engine" else GPU_GAUGES
    peaks = {n: c for n, c in PEAKS.items() if n in gauges}
    extra = ["preemptions"] if kind == "engine" else []
    columns = ["instance", "labels", *gauges.values(), *peaks.values(), *extra, "newest"]
    scraped = selection(f).scraped
    if not scraped:
        return pd.DataFrame(columns=columns)
    db = engine(f.db_url)
    rows: dict[SeriesId, dict[str, Any]] = {}
    for name, column in gauges.items():
        for sid, (ts, value) in newest(db, name, f, scraped).items():
            row = rows.setdefault(sid, {"instance": sid.instance, "labels": label_text(sid.labels), "newest": ts})
            row[column], row["newest"] = value, max(row["newest"], ts)
    for name, column in peaks.items():
        for sid, value in peak(db, name, f, scraped).items():
            if sid in rows:
                rows[sid][column] = value
    if kind == "engine":
        increases = queries.counter_increase(db, name="preemptions_total", start=f.start, end=f.end, instances=scraped)
        for sid, value in increases.items():
            if sid in rows:
                rows[sid]["preemptions"] = value
    df = pd.DataFrame(list(rows.values()), columns=columns).sort_values(["instance", "labels"], ignore_index=True)
    for name, column in gauges.items():
        if name.endswith("_bytes"):
            df[column] = df[column] / GIB
    # A gauge none of these label sets exports (vLLM has no swapped count in v1) is left out, not shown empty.
    df = df.drop(columns=[c for c in [*gauges.values(), *peaks.values()] if df[c].isna().all()])
    df["newest"] = to_time(df["newest"])
    return df


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


def _per_instance(values: dict[SeriesId, float]) -> dict[str, float]:
    return {sid.instance: v for sid, v in queries.group_sum(values, by=("instance",)).items()}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def instance_rows(f: Filters) -> dict[str, dict[str, Any]]:
    """instance -> the overview's per-instance figures from its scrapes, for instances without engine events."""
    names = list(selection(f).scrape_only)
    if not names:
        return {}
    db = engine(f.db_url)
    kw: dict[str, Any] = {"start": f.start, "end": f.end, "instances": names}
    requests = queries.counter_increase(db, name="requests_total", **kw)
    per_instance_requests = _per_instance(requests)
    failed = _per_instance({sid: v for sid, v in requests.items() if FAILED & set(sid.labels)})
    rates = {
        n: _per_instance(queries.counter_rate(db, name=n, **kw))
        for n in ("requests_total", "generation_tokens_total", "prompt_tokens_total")
    }
    preemptions = _per_instance(queries.counter_increase(db, name="preemptions_total", **kw))
    ttft = queries.histogram_quantiles(db, name="ttft_seconds", quantiles=(0.5, 0.99), **kw)
    e2e = queries.histogram_quantiles(db, name="e2e_seconds", quantiles=(0.99,), **kw)
    combined: dict[str, dict[str, float]] = defaultdict(dict)
    last: dict[str, float] = {}
    for name, how in (
        ("queue_depth", sum),
        ("running", sum),
        ("kv_usage", max),
        ("utilization", max),
        ("memory_usage", max),
    ):
        by_instance: dict[str, list[float]] = defaultdict(list)
        for sid, (ts, value) in newest(db, name, f, names).items():
            by_instance[sid.instance].append(value)
            last[sid.instance] = max(last.get(sid.instance, ts), ts)
        for inst, values in by_instance.items():
            combined[inst][name] = how(values)
    out = {}
    for inst in names:
        t, e, g = ttft.get(SeriesId(inst)), e2e.get(SeriesId(inst)), combined.get(inst, {})
        has_counts = inst in per_instance_requests or inst in rates["generation_tokens_total"]
        if not (has_counts or t or e or g):
            continue
        counted = inst in per_instance_requests
        out[inst] = {  # None where the instance exports no such counter (a DCGM exporter serves no requests)
            "requests": _rounded(per_instance_requests.get(inst)),
            "failed": _rounded(failed.get(inst, 0.0)) if counted else None,
            "req/s": rates["requests_total"].get(inst),
            "output tok/s": rates["generation_tokens_total"].get(inst),
            "prompt tok/s": rates["prompt_tokens_total"].get(inst),
            "preemptions": _rounded(preemptions.get(inst)),
            "TTFT p50 (s)": t.quantiles[0.5] if t else None,
            "TTFT p99 (s)": t.quantiles[0.99] if t else None,
            "e2e p99 (s)": e.quantiles[0.99] if e else None,
            "KV usage": g.get("kv_usage"),
            "utilization": g.get("utilization"),
            "memory": g.get("memory_usage"),
            "queue depth": g.get("queue_depth"),
            "running": g.get("running"),
            "last sample": last.get(inst),
        }
    return out


SERVING = ("requests", "TTFT p50 (s)", "queue depth", "KV usage")


def serving_instances(f: Filters) -> tuple[str, ...]:
    """Scrape-only instances that serve requests (counters, latency histograms, queue or KV gauges), not a
    GPU exporter: the ones whose per-request figures are missing."""
    return tuple(n for n, row in instance_rows(f).items() if any(row[c] is not None for c in SERVING))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def totals(f: Filters) -> dict[str, Any]:
    """Headline numbers of a selection without engine events, from counters and histogram buckets."""
    names = list(selection(f).scraped)
    out: dict[str, Any] = {"requests": 0, "failed": 0, "requests_per_s": 0.0, "output_tokens_per_s": 0.0}
    out |= {f"{key}_p{q}": None for key in ("ttft", "itl") for q in (50, 99)}
    if not names:
        return out
    db = engine(f.db_url)
    kw: dict[str, Any] = {"start": f.start, "end": f.end, "instances": names}
    requests = queries.counter_increase(db, name="requests_total", **kw)
    out["requests"] = round(sum(requests.values()))
    out["failed"] = round(sum(v for sid, v in requests.items() if FAILED & set(sid.labels)))
    out["requests_per_s"] = sum(queries.counter_rate(db, name="requests_total", **kw).values())
    out["output_tokens_per_s"] = sum(queries.counter_rate(db, name="generation_tokens_total", **kw).values())
    for base, key in (("ttft_seconds", "ttft"), ("itl_seconds", "itl")):
        # by=(): every selected instance's buckets summed into one distribution.
        merged = queries.histogram_quantiles(db, name=base, quantiles=(0.5, 0.99), by=(), **kw)
        stats = next(iter(merged.values()), None)
        if stats:
            out[f"{key}_p50"], out[f"{key}_p99"] = stats.quantiles[0.5], stats.quantiles[0.99]
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def histogram_summary(f: Filters) -> pd.DataFrame:
    """Per scraped instance and histogram: observations, mean and p50/p90/p99 over the window."""
    columns = [
        "instance",
        "metric",
        "observations",
        "mean (s)",
        *(f"p{round(q * 100)} (s)" for q in HISTOGRAM_QUANTILES),
    ]
    names = list(selection(f).scraped)
    rows = []
    for base, label in HISTOGRAMS.items() if names else ():
        got = queries.histogram_quantiles(
            engine(f.db_url), name=base, start=f.start, end=f.end, quantiles=HISTOGRAM_QUANTILES, instances=names
        )
        for group, h in got.items():
            rows.append(
                {
                    "instance": group.instance,
                    "metric": label,
                    "observations": round(h.count),
                    "mean (s)": h.mean,
                    **{f"p{round(q * 100)} (s)": h.quantiles[q] for q in HISTOGRAM_QUANTILES},
                }
            )
    return pd.DataFrame(rows, columns=columns).sort_values(["instance", "metric"], ignore_index=True)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def histogram_over_time(f: Filters, base: str) -> pd.DataFrame:
    """p50/p90/p99 of a scraped histogram per instance per bar bucket (a bucket holds a few scrapes)."""
    names = list(selection(f).scraped)
    got = (
        queries.histogram_quantiles_over_time(
            engine(f.db_url),
            name=base,
            start=f.start,
            end=f.end,
            bucket_s=f.bar_bucket_s,
            quantiles=HISTOGRAM_QUANTILES,
            instances=names,
        )
        if names
        else {}
    )
    rows = [
        {"instance": g.instance, "ts": h.ts, "quantile": f"p{round(q * 100)}", "seconds": v, "observations": h.count}
        for g, points in got.items()
        for h in points
        for q, v in h.quantiles.items()
        if v is not None
    ]
    df = pd.DataFrame(rows, columns=["instance", "ts", "quantile", "seconds", "observations"])
    df["time"] = to_time(df["ts"])
    return df
