"""The overview: headline numbers, one row per instance whatever its source, gauges over time per label set."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pandas as pd
import streamlit as st

from collector import queries
from collector.series import SAMPLE_COLUMNS
from dashboard.data import scraped
from dashboard.data.base import TTL_S, Filters, engine, label_text, to_time
from dashboard.data.catalog import instance_labels, selection
from dashboard.data.latency import QUANTILES

SUMMARY_COLUMNS = [
    "instance",
    "source",
    "labels",
    "requests",
    "failed",
    "req/s",
    "output tok/s",
    "prompt tok/s",
    "preemptions",
    "TTFT p50 (s)",
    "TTFT p99 (s)",
    "e2e p99 (s)",
    "KV usage",
    "utilization",
    "memory",
    "queue depth",
    "running",
    "last sample",
]
GAUGE_COLUMNS = ["instance", "labels", "line", "ts", "series", "value"]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def traffic_spans(f: Filters) -> dict[str, tuple[float, float]]:
    """instance -> (first, last) edge of the chart buckets holding its finished requests, inside the window.

    Rates divide by this span, not by the window: a two-minute burst in an hour's window is a two-minute
    rate, not a sixtieth of it. Precise to one chart bucket (1 s for windows up to five minutes).
    """
    db = engine(f.db_url)
    names = f.instance_list
    if names is None:
        names = [r.group for r in queries.request_rates(db, start=f.start, end=f.end, run_id=f.run_id)]
    out = {}
    for name in names:
        buckets = queries.stage_breakdown_over_time(
            db, start=f.start, end=f.end, bucket_s=f.bucket_s, instances=[name], run_id=f.run_id
        )
        if buckets:
            first, last = max(f.start, buckets[0].ts), min(f.end, buckets[-1].ts + f.bucket_s)
            out[name] = (first, max(last, first + 1e-3))
    return out


def span_of(spans: dict[str, tuple[float, float]], names: Iterable[str] | None = None) -> float:
    """Seconds from the first to the last traffic of `names` (all of them by default); 0 without any."""
    chosen = [spans[n] for n in (spans if names is None else names) if n in spans]
    if not chosen:
        return 0.0
    return max(hi for _, hi in chosen) - min(lo for lo, _ in chosen)


def _per_s(amount: float, span_s: float) -> float:
    return amount / span_s if span_s > 0 else 0.0


@st.cache_data(ttl=TTL_S, show_spinner=False)
def totals(f: Filters) -> dict[str, Any]:
    """Headline numbers from per-request events: request counts, rates over the span with traffic,
    TTFT/TPOT/e2e exact quantiles; TTFT and e2e user-facing (`queries.headline_latency`), its source named."""
    db = engine(f.db_url)
    rates = queries.request_rates(
        db, start=f.start, end=f.end, group_by="all", instances=f.instance_list, run_id=f.run_id
    )
    out: dict[str, Any] = {"requests": 0, "finished": 0, "failed": 0, "rejected": 0, "aborted": 0}
    span_s = span_of(traffic_spans(f)) or f.end - f.start  # no finished request: the window
    out["traffic_s"] = span_s
    if rates:
        r = rates[0]
        out.update({k: getattr(r, k) for k in ("requests", "finished", "failed", "rejected", "aborted")})
        # request_rates divides by the window; undo that and divide by the span with traffic instead.
        out["requests_per_s"] = _per_s(r.requests, span_s)
        out["output_tokens_per_s"] = _per_s(r.output_tokens_per_s * r.window_s, span_s)
        out["prompt_tokens_per_s"] = _per_s(r.prompt_tokens_per_s * r.window_s, span_s)
    else:
        out.update(requests_per_s=0.0, output_tokens_per_s=0.0, prompt_tokens_per_s=0.0)
    for metric in ("ttft", "tpot", "e2e"):
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
        for q in QUANTILES:
            out[f"{metric}_p{round(q * 100)}"] = stats[0].quantiles[q] if stats else None
    headline = queries.headline_latency(db, start=f.start, end=f.end, instances=f.instance_list, run_id=f.run_id)
    out.update(ttft_p50=headline.ttft_p50_s, ttft_p99=headline.ttft_p99_s, latency_source=headline.source)
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def telemetry_lost(f: Filters) -> pd.DataFrame:
    """Events the engines' sinks lost in the window (their gap records), one row per instance, type and
    reason: the numbers on this page are short by these."""
    rows = queries.lost_events(engine(f.db_url), start=f.start, end=f.end, instances=f.instance_list, run_id=f.run_id)
    return pd.DataFrame(
        [r.__dict__ for r in rows if f.shows(r.instance)],
        columns=["instance", "kind", "reason", "events", "first_ts", "last_ts"],
    )


def _memory_fraction(sample: dict[str, Any]) -> float | None:
    used, total = sample.get("memory_used_bytes"), sample.get("memory_total_bytes")
    return used / total if used is not None and total else None


@st.cache_data(ttl=TTL_S, show_spinner=False)
def instance_summary(f: Filters) -> pd.DataFrame:
    """One row per instance with data in the window: traffic, latency and its newest gauges.

    Instances with engine events show exact figures from them; instances that are only scraped show
    counter rates, histogram percentiles and gauges, the fullest engine or GPU where they have several.
    """
    db = engine(f.db_url)
    kw = {"start": f.start, "end": f.end, "instances": f.instance_list, "run_id": f.run_id}
    rates = {r.group: r for r in queries.request_rates(db, group_by="instance", **kw)}
    ttft = {
        s.group: s
        for s in queries.latency_percentiles(db, metric="ttft", quantiles=(0.5, 0.99), group_by="instance", **kw)
    }
    e2e = {
        s.group: s for s in queries.latency_percentiles(db, metric="e2e", quantiles=(0.99,), group_by="instance", **kw)
    }
    latest = queries.latest_samples(db, **kw)
    labels = instance_labels(f.db_url)
    spans = traffic_spans(f)
    rows: dict[str, dict[str, Any]] = {}
    for name in sorted(set(rates) | set(latest) | set(ttft)):
        r, s, t, e = rates.get(name), latest.get(name, {}), ttft.get(name), e2e.get(name)
        span_s = span_of(spans, [name]) or f.end - f.start
        rows[name] = {
            "source": "push",
            "requests": r.requests if r else 0,
            "failed": (r.failed + r.rejected + r.aborted) if r else 0,
            "req/s": _per_s(r.requests, span_s) if r else 0.0,
            "output tok/s": _per_s(r.output_tokens_per_s * r.window_s, span_s) if r else 0.0,
            "prompt tok/s": _per_s(r.prompt_tokens_per_s * r.window_s, span_s) if r else 0.0,
            "preemptions": r.preemptions if r else 0,
            "TTFT p50 (s)": t.quantiles[0.5] if t else None,
            "TTFT p99 (s)": t.quantiles[0.99] if t else None,
            "e2e p99 (s)": e.quantiles[0.99] if e else None,
            "KV usage": s.get("kv_usage"),
            "utilization": s.get("utilization"),
            "memory": _memory_fraction(s),
            "queue depth": s.get("queue_depth"),
            "running": s.get("running"),
            "last sample": s.get("ts"),
        }
    for name, row in scraped.instance_rows(f).items():
        rows.setdefault(name, {"source": "scrape", **row})
    df = pd.DataFrame(
        [{"instance": n, "labels": labels.get(n, ""), **rows[n]} for n in sorted(rows)], columns=SUMMARY_COLUMNS
    )
    df["last sample"] = to_time(df["last sample"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def throughput(f: Filters) -> pd.DataFrame:
    """Engine tokens/s per bucket and instance, from step events (downsampled in SQL)."""
    data = queries.throughput_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    rows = [
        {
            "instance": inst,
            "ts": b.ts,
            "prefill tok/s": b.prefill_tokens_per_s,
            "decode tok/s": b.decode_tokens_per_s,
            "busy": b.busy_fraction,
            "step (s)": b.mean_step_s,
        }
        for inst, buckets in data.items()
        for b in buckets
    ]
    df = pd.DataFrame(rows, columns=["instance", "ts", "prefill tok/s", "decode tok/s", "busy", "step (s)"])
    df["time"] = to_time(df["ts"])
    return df


IDENTIFYING = ("gpu", "engine", "GPU_I_ID", "device", "model_name")  # one of these alone names a series best


def line_names(sids: Iterable[queries.SeriesId]) -> dict[queries.SeriesId, str]:
    """A chart line's name: the instance, and what tells its series apart (`dcgm-a · gpu=1`).

    Labels that all series of an instance share are left out; when one identifying label (gpu, engine)
    alone tells them apart, it is the only one shown.
    """
    by_instance: dict[str, list[queries.SeriesId]] = defaultdict(list)
    for sid in dict.fromkeys(sids):
        by_instance[sid.instance].append(sid)
    out = {}
    for inst, group in by_instance.items():
        if len(group) == 1:
            out[group[0]] = inst
            continue
        shared = set.intersection(*(set(s.labels) for s in group))
        key = next((k for k in IDENTIFYING if len({s.label_dict().get(k) for s in group}) == len(group)), None)
        for sid in group:
            kept = [(key, sid.label_dict()[key])] if key else [p for p in sid.labels if p not in shared]
            out[sid] = " · ".join([inst, label_text(tuple(kept))])
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def gauges(
    f: Filters, names: tuple[str, ...], agg: str = "avg", instances: tuple[str, ...] | None = None
) -> pd.DataFrame:
    """Canonical gauge series per bucket, one line per label set (long format: instance, line, time, series, value).

    `agg="max"` shows each bucket's peak, as next to a `> threshold` rule. With a run selected,
    engine-sampled gauges come from that run's samples only (bucket averages); scraped series carry no run
    and are shown whole. `instances`: only these (within the sidebar's pick), where a caller needs a few.
    """
    db = engine(f.db_url)
    wanted = f.instance_list
    if instances is not None:
        picked = None if wanted is None else set(wanted)
        wanted = [i for i in instances if picked is None or i in picked]
    rows = []
    per_run = [n for n in names if n in SAMPLE_COLUMNS] if f.run_id is not None else []
    if per_run:
        by_name = queries.run_gauges_over_time(
            db, names=per_run, start=f.start, end=f.end, bucket_s=f.bucket_s, run_id=f.run_id, instances=wanted
        )
        for name, per_instance in by_name.items():
            for inst, points in per_instance.items():
                rows.extend(
                    {"instance": inst, "labels": "", "line": inst, "ts": ts, "series": name, "value": v}
                    for ts, v in points
                )
    pushed = set(selection(f).pushed)
    found: list[tuple[str, queries.SeriesId, list[tuple[float, float]]]] = []
    for name in names:
        series = queries.bucketed(
            db, name=name, start=f.start, end=f.end, bucket_s=f.bucket_s, instances=wanted, agg=agg
        )
        for sid, points in series.items():
            if name in per_run and not sid.labels and sid.instance in pushed:
                continue  # the run's own samples are above
            found.append((name, sid, points))
    lines = line_names(sid for _, sid, _ in found)
    for name, sid, points in found:
        rows.extend(
            {
                "instance": sid.instance,
                "labels": label_text(sid.labels),
                "line": lines[sid],
                "ts": ts,
                "series": name,
                "value": v,
            }
            for ts, v in points
        )
    df = pd.DataFrame(rows, columns=GAUGE_COLUMNS)
    df["time"] = to_time(df["ts"])
    return df
