"""Overview: is the fleet healthy right now? Traffic, latency, KV and accelerator load, firing alerts, per instance."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, timewin, ui
from dashboard.data import alerting, catalog, load, scraped, serving
from dashboard.tables import GPU_TABLE, SCRAPED_ENGINE_TABLE, Col, show

st.title("Overview")
f = ui.current_filters()
sel = catalog.selection(f)
ui.page_caption(f"Requests, engine steps, scrapes and gauges in {ui.window_text()}.")

with ui.guarded("Headline numbers"):
    cols = st.columns(6)
    if sel.pushed or not sel.scraped:
        t = serving.totals(f)
        cols[0].metric("Requests", f"{t['requests']:,}", help="requests that left the engine in the window")
        cols[1].metric(
            "Requests/s", f"{t['requests_per_s']:.2f}", help="requests over the time with traffic, not the window"
        )
        cols[1].caption(f"over {timewin.fmt_span(t['traffic_s'])} with traffic")
        cols[2].metric("Output tokens/s", ui.fmt_num(t["output_tokens_per_s"]), help="finished requests' tokens")
        cols[3].metric(
            "TTFT p99", ui.fmt_s(t["ttft_p99"]), help="time to first token from the HTTP arrival, finished requests"
        )
        cols[3].caption(f"p50 {ui.fmt_s(t['ttft_p50'])}")
        cols[4].metric("TPOT p99", ui.fmt_s(t["tpot_p99"]), help="decode time per output token after the first")
        cols[4].caption(f"p50 {ui.fmt_s(t['tpot_p50'])}")
        failed = t["failed"] + t["rejected"] + t["aborted"]
        st.caption(f"TTFT and e2e as users waited them; source: {t['latency_source']}.")
        scraped_rows = scraped.instance_rows(f)
        if scraped_rows:
            st.caption(
                f"Headline numbers from the per-request events of {', '.join(sel.pushed)}; "
                f"{', '.join(scraped_rows)} (scraped only) are in the tables below."
            )
    else:
        t = scraped.totals(f)
        cols[0].metric("Requests", f"{t['requests']:,}", help="increase of the scraped requests counters")
        cols[1].metric("Requests/s", f"{t['requests_per_s']:.2f}", help="between each counter's first and last scrape")
        cols[2].metric("Output tokens/s", ui.fmt_num(t["output_tokens_per_s"]))
        cols[3].metric("TTFT p99", ui.fmt_s(t["ttft_p99"]), help="from the scraped histogram buckets")
        cols[3].caption(f"p50 {ui.fmt_s(t['ttft_p50'])}")
        cols[4].metric("ITL p99", ui.fmt_s(t["itl_p99"]), help="inter-token latency, from histogram buckets")
        cols[4].caption(f"p50 {ui.fmt_s(t['itl_p50'])}")
        failed = t["failed"]
        st.caption(
            "From scraped counters and histogram buckets: percentiles are precise to a bucket's width "
            "(the Latency page says what would give exact ones). vLLM's histograms start at its own "
            "arrival stamp, after its API server has read the request: users waited longer."
        )
    cols[5].metric("Not finished", f"{failed:,}", help="failed, rejected or aborted requests")
    cols[5].caption(f"{failed / t['requests']:.1%} of requests" if t["requests"] else "no requests")
    if f.hidden:
        st.caption(f"Simulated and trial runs ({', '.join(f.hidden)}) are left out; the sidebar adds them.")

with ui.guarded("Telemetry lost"):
    lost = serving.telemetry_lost(f)
    if not lost.empty:
        lines = [
            f"`{r.instance}`: {r.events:,} {r.kind} events ({r.reason.replace('_', ' ')}) "
            f"from {timewin.fmt_ts(r.first_ts)} to {timewin.fmt_ts(r.last_ts)}"
            for r in lost.itertuples()
        ]
        st.warning(
            f"**Telemetry lost: {lost['events'].sum():,} events** never reached the collector; the numbers in "
            "this window are short by them.\n\n- " + "\n- ".join(lines),
            icon=":material/report:",
        )

with ui.guarded("Firing alerts"):
    alerts = alerting.alert_states(f.db_url)
    active = alerts[alerts["state"].isin(["firing", "pending"]) & alerts["instance"].map(f.shows)]
    firing = active[active["state"] == "firing"]
    if firing.empty:
        pending = len(active)
        st.success(f"No alerts firing{f' ({pending} pending)' if pending else ''}.", icon=":material/check_circle:")
    else:
        lines = [
            f"**{r.alertname}** on `{r.instance or 'all'}` ({r.severity or 'no severity'}): {r.summary}"
            for r in firing.itertuples()
        ]
        st.error(
            f"**{len(firing)} alert(s) firing** — see the Alerts page.\n\n- " + "\n- ".join(lines),
            icon=":material/notifications_active:",
        )

TRAFFIC_TABLE = {
    "instance": Col("Instance", width=150),
    "requests": Col("Requests", "count"),
    "failed": Col("Not finished", "count", help="failed, rejected or aborted"),
    "req/s": Col("Requests/s", "number", help="over the time with traffic"),
    "output tok/s": Col("Output tok/s", "number"),
    "prompt tok/s": Col("Prompt tok/s", "number"),
    "preemptions": Col("Preemptions", "count"),
    "TTFT p50 (s)": Col("TTFT p50", "seconds"),
    "TTFT p99 (s)": Col("TTFT p99", "seconds"),
    "e2e p99 (s)": Col("E2E p99", "seconds"),
}
NOW_TABLE = {
    "instance": Col("Instance", width=150),
    "source": Col("Source", help="push: engine events; scrape: a /metrics target"),
    "KV usage": Col("KV cache", "bar", width=120, help="newest sample; the fullest engine"),
    "utilization": Col("Busy", "bar", width=120, help="newest sample; the busiest GPU"),
    "memory": Col("Memory", "bar", width=120, help="newest sample; the fullest GPU"),
    "queue depth": Col("Queued", "number"),
    "running": Col("Running", "number"),
    "last sample": Col("Newest sample", "time"),
    "labels": Col("Labels", width="medium"),
}
st.subheader("Per instance")
with ui.guarded("Per instance"):
    summary = serving.instance_summary(f)
    if summary.empty:
        ui.empty(
            "engine data",
            "Start an engine that pushes to the collector (`kvpilot engine serve`) or register a scrape target, "
            "widen the time range, or clear the instance/run filters.",
        )
    else:
        show(summary, TRAFFIC_TABLE)
        st.markdown("**Now** (the newest sample or scrape of each instance in the window)")
        show(summary, NOW_TABLE)
        if (summary["source"] == "scrape").any():
            st.caption(
                "Scraped instances: requests and token rates from counters, TTFT and e2e from histogram "
                "buckets; queue and running add up over engines, KV, utilization and memory show the fullest "
                "engine or GPU (each one is in the tables below)."
            )

if sel.scraped:
    with ui.guarded("Scraped engines and GPUs"):
        engines, gpus = scraped.label_sets(f, "engine"), scraped.label_sets(f, "gpu")
        if not engines.empty:
            st.markdown("**Scraped engines** (one row per label set: engine, model)")
            show(engines, SCRAPED_ENGINE_TABLE)
        if not gpus.empty:
            st.markdown("**Accelerators** (one row per GPU; highest sample = the highest value scraped in the window)")
            show(gpus, GPU_TABLE)

left, right = st.columns(2)
with left, ui.guarded("Throughput"):
    tp = serving.throughput(f)
    if tp.empty:
        ui.empty(
            "engine steps",
            "Steps come from kvpilot engines and from vLLM's iteration log (`kvpilot vllm serve`); scraped "
            "servers show token rates above.",
        )
    else:
        long = tp.melt(
            id_vars=["instance", "time"],
            value_vars=["prefill tok/s", "decode tok/s"],
            var_name="kind",
            value_name="tokens/s",
        )
        st.altair_chart(
            charts.lines(
                long,
                y="tokens/s",
                color="instance",
                dash="kind",
                title=f"Engine throughput (mean per {timewin.fmt_span(f.bucket_s)})",
                subtitle="every step's tokens, in the bucket where the step ran (from its end and duration)",
                y_title="tokens/s",
            ),
            width="stretch",
        )
with right, ui.guarded("Queue and running"):
    g = load.over_time(f, ("running", "queue_depth"))
    if g.empty:
        ui.empty("steps or queue samples", "Engine steps (or sampled gauges) say how many requests ran and waited.")
    else:
        p = load.peaks(f)
        running, waiting = (ui.fmt_num(v) for v in (p.running_peak, p.waiting_peak))
        st.caption(f"{load.figure('Running', running, p.source)}; {load.figure('waiting', waiting, p.waiting_source)}")
        g["series"] = g["series"].map({"running": "running", "queue_depth": "waiting"})
        st.altair_chart(
            charts.lines(
                g,
                y="value",
                color="line",
                dash="series",
                y_title="requests",
                title="Requests running and waiting",
                subtitle=load.describe(g, timewin.fmt_span(f.bucket_s)),
                thresholds=alerting.thresholds_for("queue_depth"),
            ),
            width="stretch",
        )

left, right = st.columns(2)
with left, ui.guarded("KV usage"):
    kv = load.over_time(f, ("kv_usage",))
    if kv.empty:
        ui.empty("KV usage", "The KV memory page has the full picture once steps or samples arrive.")
    else:
        p = load.peaks(f)
        st.caption(load.figure("KV usage", ui.fmt_pct(p.kv_usage_peak), p.kv_usage_source))
        st.altair_chart(
            charts.lines(
                kv,
                y="value",
                color="line",
                title="KV cache usage (hot tier)",
                subtitle=load.describe(kv, timewin.fmt_span(f.bucket_s)),
                y_title="used",
                percent=True,
                thresholds=alerting.thresholds_for("kv_usage"),
            ),
            width="stretch",
        )
with right, ui.guarded("GPU memory"):
    memory = serving.gauges(f, ("memory_usage",), agg="max")
    if memory.empty:
        ui.empty("accelerator memory samples", "Engines on a GPU sample it; scrape a DCGM exporter for every GPU.")
    else:
        st.altair_chart(
            charts.lines(
                memory,
                y="value",
                color="line",
                title=f"Accelerator memory per GPU (highest sample per {timewin.fmt_span(f.bucket_s)})",
                y_title="used",
                percent=True,
                thresholds=alerting.thresholds_for("memory_usage"),
            ),
            width="stretch",
        )

with ui.guarded("Utilization"):
    util = serving.gauges(f, ("utilization",))
    if util.empty:
        ui.empty("utilization samples", "Engines on CPU report none; on a GPU they sample it, or scrape DCGM.")
    else:
        st.altair_chart(
            charts.lines(
                util,
                y="value",
                color="line",
                title=f"Accelerator utilization per GPU (mean per {timewin.fmt_span(f.bucket_s)})",
                y_title="busy",
                percent=True,
            ),
            width="stretch",
        )
