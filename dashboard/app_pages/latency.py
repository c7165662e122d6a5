"""Latency: where request time goes. Percentiles over time, the per-stage breakdown, distributions, the slowest."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, timewin, ui
from dashboard.data import catalog, latency, scraped
from dashboard.tables import Col, show

st.title("Latency")
f = ui.current_filters()
sel = catalog.selection(f)
ui.page_caption(
    f"Finished requests in {ui.window_text()}; percentiles from per-request events are exact (nearest rank), "
    "computed in SQL, except a whole fleet's over more than a quarter of an hour, read in whole minutes from the "
    "latency sketch (at most 2% above the exact, never below), where the stage breakdown's means come from the "
    "per-minute stage sums (exact); those from scraped histograms are precise to a bucket's width."
)

NO_REQUESTS = (
    "Requests appear here once engines push request events to the collector; widen the time range "
    "or clear the instance/run filters."
)
PER_REQUEST = "Exact percentiles, the stage breakdown, the latency distributions and the slowest requests"


def _stat_label(column: str) -> str:
    """`mean (s)` -> Mean, `p99 (s)` -> p99: the unit is in every cell."""
    name = column.removesuffix(" (s)")
    return name if name.startswith("p") else name.capitalize()


def slowest_table(ranked_by: str) -> dict[str, Col]:
    return {
        "request_id": Col("Request", width="medium"),
        ranked_by: Col(ranked_by.removesuffix(" (s)"), "seconds", help="what the list is ranked by"),
        "instance": Col("Instance"),
        "finished at": Col("Finished at", "time"),
        "status": Col("Status"),
        **{
            f"{stage}_s": Col(label, "seconds")
            for stage, label in (
                ("queue", "Queue"),
                ("prefill", "Prefill"),
                ("ttft", "TTFT"),
                ("decode", "Decode"),
                ("swap", "Swap"),
                ("e2e", "E2E"),
            )
        },
        "prompt_tokens": Col("Prompt tokens", "count"),
        "output_tokens": Col("Output tokens", "count"),
        "cached_tokens": Col("Cached tokens", "count"),
        "preemptions": Col("Preemptions", "count"),
        "swaps": Col("Swaps", "count"),
        "finish_reason": Col("Finish reason"),
        "run_id": Col("Run", width="medium"),
    }


def scraped_histograms() -> None:
    """TTFT, ITL, e2e and queue time percentiles of the scraped instances, from their histogram buckets."""
    st.subheader("From scraped histograms")
    with ui.guarded("Scraped histograms"):
        table = scraped.histogram_summary(f)
        if table.empty:
            ui.empty(
                "histogram observations",
                "vLLM, SGLang and kvpilot expose TTFT, ITL and end-to-end histograms on /metrics; the "
                "collector keeps their buckets once it scrapes them.",
            )
            return
        st.caption(
            "The engine's own view, precise to a bucket: vLLM's histograms start at its arrival stamp, after its "
            "API server has read the request, so they leave out the time before the engine that users waited."
        )
        show(
            table,
            {
                "instance": Col("Instance", width="medium"),
                "metric": Col("Metric"),
                "observations": Col("Observations", "count"),
                **{c: Col(_stat_label(c), "seconds") for c in table.columns[3:]},
            },
        )
        shown = [b for b, label in scraped.HISTOGRAMS.items() if label in set(table["metric"])]
        base = (
            st.segmented_control(
                "Histogram",
                options=shown,
                default=shown[0],
                key="lat_hist_metric",
                format_func=lambda b: scraped.HISTOGRAMS[b],
                label_visibility="collapsed",
            )
            or shown[0]
        )
        over_time = scraped.histogram_over_time(f, base)
        if not over_time.empty:
            st.altair_chart(
                charts.lines(
                    over_time,
                    y="seconds",
                    color="instance",
                    dash="quantile",
                    title=f"{scraped.HISTOGRAMS[base]} p50 / p90 / p99 per {timewin.fmt_span(f.bar_bucket_s)} "
                    "(from histogram buckets)",
                    y_title="seconds",
                    y_format=".3~g",
                ),
                width="stretch",
            )


summary = None
with ui.guarded("Summary"):
    summary = latency.summary(f)
if summary is None:
    st.stop()
if summary.empty:
    if not sel.scraped:
        ui.empty("finished requests", NO_REQUESTS)
        st.stop()
    scraped_histograms()
    if sel.scrape_only:
        ui.needs_events(PER_REQUEST, scraped.serving_instances(f) or sel.scrape_only)
    st.stop()
if scraped.serving_instances(f):
    st.caption(
        f"Per-request figures of {', '.join(sel.pushed)}; {', '.join(scraped.serving_instances(f))} (scraped "
        "only) are under 'From scraped histograms' at the end."
    )
by_stage = summary.set_index("stage")
cols = st.columns(4)
for col, stage in zip(cols[:3], ("TTFT", "TPOT", "End to end"), strict=True):
    if stage in by_stage.index:
        row = by_stage.loc[stage]
        col.metric(
            f"{stage} p99",
            ui.fmt_s(row["p99 (s)"]),
            help=f"p50 {ui.fmt_s(row['p50 (s)'])} · p90 {ui.fmt_s(row['p90 (s)'])} · max {ui.fmt_s(row['max (s)'])}",
        )
        col.caption(f"p50 {ui.fmt_s(row['p50 (s)'])} · p90 {ui.fmt_s(row['p90 (s)'])}")
cols[3].metric("Finished requests", f"{int(by_stage['requests'].max()):,}")
with ui.guarded("Latency source"):
    st.caption(
        f"TTFT and end to end as users waited them, from the HTTP arrival; source: {latency.source(f)}. "
        "'Before the engine' is the time from the HTTP arrival to the engine's own arrival stamp."
    )
show(
    summary,
    {
        "stage": Col("Stage"),
        "requests": Col("Requests", "count"),
        **{c: Col(_stat_label(c), "seconds") for c in summary.columns[2:]},
    },
)

st.subheader("Percentiles over time")
metric = (
    st.segmented_control(
        "Metric",
        options=["ttft", "tpot", "e2e"],
        default="ttft",
        key="lat_metric",
        format_func=lambda m: latency.LATENCY_METRICS[m],
        label_visibility="collapsed",
    )
    or "ttft"
)
with ui.guarded("Percentiles over time"):
    over_time = latency.over_time(f, metric)
    if over_time.empty:
        ui.empty(f"{latency.LATENCY_METRICS[metric]} values", "TPOT needs requests with more than one output token.")
    else:
        log = st.toggle("Log scale", key="lat_log", help="keeps p50 readable next to a slow tail")
        st.altair_chart(
            charts.lines(
                over_time,
                y="seconds",
                color="quantile",
                log=log,
                title=f"{latency.LATENCY_METRICS[metric]} p50 / p90 / p99 per {timewin.fmt_span(f.bucket_s)}",
                y_title="seconds",
                y_format=".3~g",
            ),
            width="stretch",
        )

st.subheader("Where the time goes")
with ui.guarded("Stage breakdown"):
    stages = latency.stage_breakdown(f)
    if stages.empty:
        ui.empty("finished requests", NO_REQUESTS)
    else:
        st.altair_chart(
            charts.stacked_stages(stages, title="Mean seconds per request by stage (bar = mean e2e)"), width="stretch"
        )
        per_bucket = stages.drop_duplicates("ts")
        swaps, preemptions = int(per_bucket["swaps"].sum()), int(per_bucket["preemptions"].sum())
        mean_swap = by_stage.loc["Swap", "mean (s)"] if "Swap" in by_stage.index else 0.0
        st.caption(
            "Before the engine: HTTP arrival to the engine's arrival stamp (vLLM: its API server reading the "
            "request) · queue: arrival to first schedule · prefill: schedule to prompt processed · first-token "
            "gap: prefill done to first token · decode: first token to finish, less the time swapped out · "
            "swap: time swapped out to the host tier (the engine counts it inside the stage it interrupted; "
            "here it is a stage of its own, while time preempted for recompute stays in decode). In this window "
            f"requests were swapped {swaps:,} times, for a mean of {ui.fmt_s(mean_swap)} swapped out per request, "
            f"and preempted {preemptions:,} times."
        )

st.subheader("Distributions")
left, right = st.columns(2)
for col, hist_metric in ((left, "ttft"), (right, "e2e")):
    with col, ui.guarded(f"{latency.LATENCY_METRICS[hist_metric]} histogram"):
        clip = (
            by_stage.loc[latency.LATENCY_METRICS[hist_metric], "p95 (s)"]
            if latency.LATENCY_METRICS[hist_metric] in by_stage.index
            else None
        )
        full = st.toggle("Spread out the slowest 5%", key=f"hist_full_{hist_metric}", value=False)
        bins = latency.histogram(f, hist_metric, None if full else clip)
        if bins.empty:
            ui.empty(f"{latency.LATENCY_METRICS[hist_metric]} values", NO_REQUESTS)
        else:
            note = "" if full else " (to p95; slower ones in the last bar)"
            st.altair_chart(
                charts.histogram(
                    bins, title=f"{latency.LATENCY_METRICS[hist_metric]} distribution{note}", x_title="seconds"
                ),
                width="stretch",
            )

st.subheader("Slowest requests")
rank = st.selectbox(
    "Rank by",
    options=list(latency.LATENCY_METRICS),
    index=2,
    key="slow_metric",
    format_func=lambda m: latency.LATENCY_METRICS[m],
)
with ui.guarded("Slowest requests"):
    slow = latency.slowest(f, rank)
    if slow.empty:
        ui.empty("requests", NO_REQUESTS)
    else:
        show(slow, slowest_table(latency.LATENCY_METRICS[rank] + " (s)"))

if sel.scraped:
    scraped_histograms()
    if sel.scrape_only:
        ui.needs_events(PER_REQUEST, scraped.serving_instances(f) or sel.scrape_only)
