"""Latency from per-request events: exact percentiles, stages, distributions, the slowest requests.

These need events per request (kvpilot's engine push; vLLM's traces); instances that are only scraped
get bucket percentiles from `dashboard.data.scraped` instead.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine, to_time

LATENCY_METRICS = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "e2e": "End to end",
    "frontend": "Before the engine",
    "queue": "Queue",
    "prefill": "Prefill",
    "decode": "Decode",
    "swap": "Swap",
}
QUANTILES = (0.5, 0.9, 0.95, 0.99)

# The stacked stages, in stack order; they add up to the mean user-facing e2e. Decode excludes the swap stage.
STAGES = {
    "frontend_s": "before the engine",
    "queue_s": "queue",
    "prefill_s": "prefill",
    "first_token_gap_s": "first-token gap",
    "decode_excl_swap_s": "decode",
    "swap_s": "swap",
}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def source(f: Filters) -> str:
    """Where the headline TTFT and e2e come from (`queries.headline_latency`), for the page to name."""
    return queries.headline_latency(
        engine(f.db_url), start=f.start, end=f.end, instances=f.instance_list, run_id=f.run_id
    ).source


@st.cache_data(ttl=TTL_S, show_spinner=False)
def summary(f: Filters) -> pd.DataFrame:
    """One row per stage: requests, mean, percentiles (exact, or from the latency sketch for a fleet's long
    window: `collector.queries.latency_sketch`) and max over the selection."""
    db = engine(f.db_url)
    rows = []
    for metric, label in LATENCY_METRICS.items():
        stats = queries.latency_percentiles(
            db,
            start=f.start,
            end=f.end,
            metric=metric,
            quantiles=QUANTILES,
            group_by="all",
            instances=f.instance_list,
            run_id=f.run_id,
        )
        if stats:
            s = stats[0]
            rows.append(
                {
                    "stage": label,
                    "requests": s.count,
                    "mean (s)": s.mean,
                    **{f"p{round(q * 100)} (s)": s.quantiles[q] for q in QUANTILES},
                    "max (s)": s.max,
                }
            )
    return pd.DataFrame(rows)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def over_time(f: Filters, metric: str) -> pd.DataFrame:
    buckets = queries.latency_quantiles_over_time(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        bucket_s=f.bucket_s,
        metric=metric,
        quantiles=(0.5, 0.9, 0.99),
        instances=f.instance_list,
        run_id=f.run_id,
    )
    rows = [
        {"ts": b.ts, "quantile": f"p{round(q * 100)}", "seconds": v, "requests": b.count}
        for b in buckets
        for q, v in b.quantiles.items()
        if v is not None
    ]
    df = pd.DataFrame(rows, columns=["ts", "quantile", "seconds", "requests"])
    df["time"] = to_time(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def stage_breakdown(f: Filters) -> pd.DataFrame:
    """Mean seconds per stage per bucket (long format for stacked bars, swap its own stage), with swap counts."""
    buckets = queries.stage_breakdown_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bar_bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    rows = [
        {
            "ts": b.ts,
            "stage": label,
            "seconds": getattr(b, key),
            "requests": b.requests,
            "swaps": b.swaps,
            "preemptions": b.preemptions,
            "e2e (s)": b.e2e_s,
        }
        for b in buckets
        for key, label in STAGES.items()
    ]
    df = pd.DataFrame(rows, columns=["ts", "stage", "seconds", "requests", "swaps", "preemptions", "e2e (s)"])
    df["time"] = to_time(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def histogram(f: Filters, metric: str, upper: float | None) -> pd.DataFrame:
    bins = queries.latency_histogram(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        metric=metric,
        bins=40,
        upper=upper,
        instances=f.instance_list,
        run_id=f.run_id,
    )
    return pd.DataFrame([b.__dict__ for b in bins], columns=["lo", "hi", "count"])


SLOWEST_COLUMNS = [
    "request_id",
    "instance",
    "run_id",
    "ts",
    "status",
    "metric_value",
    "frontend_s",
    "queue_s",
    "prefill_s",
    "ttft_s",
    "decode_s",
    "swap_s",
    "e2e_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "preemptions",
    "swaps",
    "finish_reason",
]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def slowest(f: Filters, metric: str, limit: int = 25) -> pd.DataFrame:
    rows = queries.slowest_requests(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        metric=metric,
        limit=limit,
        instances=f.instance_list,
        run_id=f.run_id,
    )
    df = pd.DataFrame(rows, columns=SLOWEST_COLUMNS)
    df["finished at"] = to_time(df["ts"])
    return df.rename(columns={"metric_value": LATENCY_METRICS[metric] + " (s)"}).drop(columns=["ts"])
