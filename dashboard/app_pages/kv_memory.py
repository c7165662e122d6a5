"""KV memory: how full each tier got, how much of it is wasted, and the allocation trace that got it there."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, timewin, ui
from dashboard.data import advice, alerting, catalog, kv, load, scraped, serving
from dashboard.tables import SCRAPED_ENGINE_TABLE, Col, show

st.title("KV memory")
f = ui.current_filters()
sel = catalog.selection(f)
ui.page_caption(f"KV cache samples, scrapes and allocation events in {ui.window_text()}.")
per_bucket = timewin.fmt_span(f.bucket_s)

NO_SAMPLES = (
    "KV gauges come from engine sample events (kvpilot engines send them every telemetry interval) or "
    "from scraping vLLM/SGLang; widen the time range or clear the filters."
)
PUSH_ONLY = (
    "kvpilot's engine push (`telemetry.sink: http`; `telemetry.trace_alloc` for the trace): vLLM and SGLang "
    "expose only their KV usage",
)
# What each allocation-trace operation counts, in the words of the engine's KV manager and scheduler.
OPS = {
    "alloc": ("Allocations", "KV blocks handed to a request"),
    "free": ("Frees", "blocks given back by a finished request"),
    "swap_out": ("Swapped out", "a preempted request's blocks moved to the cold (host) tier"),
    "swap_in": ("Swapped in", "blocks brought back to the hot tier when the request resumed"),
    "evict": ("Evicted", "cached (prefix) blocks dropped to make room"),
    "recycle": ("Recycled", "blocks the recycler reclaimed"),
    "oom": (
        "Alloc retries",
        "allocation attempts that found no free block: the scheduler preempted a running request and "
        "retried (the `oom` op). The request was not failed; see 'Requests failed'.",
    ),
}
kv_rules = alerting.thresholds_for("kv_usage")

with ui.guarded("KV usage peak"):
    hot = load.over_time(f, ("kv_usage",))
    if not hot.empty:
        p = load.peaks(f)
        st.markdown(load.figure("KV usage", ui.fmt_pct(p.kv_usage_peak), p.kv_usage_source))
        st.altair_chart(
            charts.lines(
                hot,
                y="value",
                color="line",
                y_title="used",
                percent=True,
                title="KV cache usage (hot tier)",
                subtitle=load.describe(hot, per_bucket),
                thresholds=kv_rules,
            ),
            width="stretch",
        )

with ui.guarded("KV usage"):
    usage = kv.usage(f)
    if usage.empty:
        if not sel.scraped:
            ui.empty("KV samples", NO_SAMPLES)
    else:
        mean = usage.groupby("series")["value"].mean()
        peak = kv.peaks(f, sel.pushed)
        cols = st.columns(4)
        hot_peak = peak.get("hot tier usage")
        over = [t for t in kv_rules if t.op in (">", ">=") and hot_peak is not None and hot_peak > t.level]
        cols[0].metric(
            "Hot tier, highest sample",
            ui.fmt_pct(hot_peak),
            help="the highest KV usage sampled in the window: what a `kv_usage > threshold` rule sees "
            "(the peak over every step is above)",
        )
        cols[0].caption(
            f"mean {ui.fmt_pct(mean.get('hot tier usage'))}"
            + (f" · over {over[0].rule}'s {over[0].level:.0%}" if over else "")
        )
        cols[1].metric("Cold tier, highest sample", ui.fmt_pct(peak.get("cold tier usage")), help="host-memory tier")
        cols[1].caption(f"mean {ui.fmt_pct(mean.get('cold tier usage'))}")
        for col, name, what in (
            (cols[2], "internal waste", "allocated slots holding no token"),
            (cols[3], "external fragmentation", "free memory too scattered for a block"),
        ):
            col.metric(f"{name.capitalize()} (mean)", ui.fmt_pct(mean.get(name)), help=what)
            col.caption(f"peak {ui.fmt_pct(usage[usage['series'] == name]['value'].max())} of bucket means")
        tiers = serving.gauges(f, ("kv_usage", "kv_cold_usage"), agg="max")
        tiers = tiers[tiers["instance"].isin(sel.pushed)].copy()
        tiers["series"] = tiers["series"].map({"kv_usage": "hot tier", "kv_cold_usage": "cold tier"})
        st.altair_chart(
            charts.lines(
                tiers,
                y="value",
                color="line",
                dash="series",
                y_title="used",
                percent=True,
                title=f"Hot (device) and cold (host) tier usage (highest sample per {per_bucket})",
                thresholds=kv_rules,
            ),
            width="stretch",
        )
        waste = usage[usage["series"].isin(["internal waste", "external fragmentation"])].copy()
        if waste.empty:
            st.info("This engine reports no waste or fragmentation gauges.", icon=":material/info:")
        else:
            st.altair_chart(
                charts.lines(
                    waste,
                    y="value",
                    color="instance",
                    dash="series",
                    percent=True,
                    y_title="of KV memory",
                    title=f"Internal waste and external fragmentation (mean per {per_bucket})",
                ),
                width="stretch",
            )

if sel.scraped:
    st.subheader("Scraped engines")
    with ui.guarded("Scraped engines"):
        engines = scraped.label_sets(f, "engine")
        gauges = serving.gauges(f, ("kv_usage", "kv_cold_usage"), agg="max")
        gauges = gauges[gauges["instance"].isin(sel.scraped)]
        if engines.empty and gauges.empty:
            ui.empty("scraped KV gauges", NO_SAMPLES)
        else:
            if not gauges.empty:
                gauges["series"] = gauges["series"].map({"kv_usage": "hot", "kv_cold_usage": "cold"})
                st.altair_chart(
                    charts.lines(
                        gauges,
                        y="value",
                        color="line",
                        dash="series",
                        y_title="used",
                        percent=True,
                        title=f"KV cache usage per engine (highest scrape per {per_bucket}: sampled, not a peak)",
                        thresholds=kv_rules,
                    ),
                    width="stretch",
                )
            show(engines, {k: c for k, c in SCRAPED_ENGINE_TABLE.items() if k not in ("queue depth", "running")})
    if sel.scrape_only:
        ui.needs_events("Internal waste, fragmentation and the KV allocation trace", sel.scrape_only, sources=PUSH_ONLY)

with ui.guarded("Accelerator memory"):
    memory = serving.gauges(f, ("memory_usage",), agg="max")
    if not memory.empty:
        st.altair_chart(
            charts.lines(
                memory,
                y="value",
                color="line",
                title=f"Accelerator memory per GPU (highest sample per {per_bucket})",
                y_title="used",
                percent=True,
                thresholds=alerting.thresholds_for("memory_usage"),
            ),
            width="stretch",
        )

left, right = st.columns(2)
with left, ui.guarded("Swap rate"):
    swaps = serving.gauges(f, ("swap_rate",), agg="max")
    if swaps.empty:
        ui.empty("swap-rate samples", "Swapping starts when the hot tier runs out; none sampled means none seen.")
    else:
        st.altair_chart(
            charts.lines(
                swaps,
                y="value",
                color="line",
                title=f"Swap rate (highest sample per {per_bucket})",
                y_title="swaps/s",
                y_format=".3~g",
                thresholds=alerting.thresholds_for("swap_rate"),
            ),
            width="stretch",
        )
with right, ui.guarded("Prefix-cache hit rate"):
    hits = serving.gauges(f, ("prefix_hit_rate",))
    if hits.empty:
        names = tuple(sorted({*sel.pushed, *sel.scraped}))
        ui.empty(
            "prefix-cache samples",
            advice.prefix_cache_hint(list(advice.engines(f.db_url, names).values()), advice.prefix_hits(f, names)),
        )
    else:
        st.altair_chart(
            charts.lines(
                hits,
                y="value",
                color="line",
                title=f"Prefix-cache hit rate (mean per {per_bucket})",
                y_title="hit rate",
                percent=True,
            ),
            width="stretch",
        )

st.subheader("Allocation trace")
with ui.guarded("Allocation trace"):
    ops = kv.alloc_ops(f)
    if ops.empty:
        if sel.scrape_only and not sel.pushed:
            st.caption("No allocation trace: the selected instances are only scraped (see the note above).")
        else:
            ui.empty("allocation events", advice.alloc_trace_hint(list(advice.engines(f.db_url, sel.pushed).values())))
    else:
        totals = ops.groupby("op")[["events", "blocks"]].sum()
        shown = [op for op in OPS if op in totals.index]
        cols = st.columns(len(shown) + 1)
        for col, op in zip(cols, shown, strict=False):
            label, what = OPS[op]
            col.metric(
                label, f"{int(totals.loc[op, 'events']):,}", help=f"{what}; {int(totals.loc[op, 'blocks']):,} blocks"
            )
        t = serving.totals(f)
        cols[-1].metric(
            "Requests failed",
            f"{t['failed']:,}",
            help="requests that ended with status 'failed' (any cause). kvpilot's engine preempts and retries "
            "rather than fail a request for lack of KV memory.",
        )
        cols[-1].caption(f"of {t['requests']:,} requests")
        if "oom" in totals.index:
            st.caption(
                f"**Alloc retries** ({int(totals.loc['oom', 'events']):,}): attempts to grow a request's KV "
                "blocks that found the hot tier full; each preempted a running request (swapped out or recomputed "
                f"later) and retried. {t['failed']:,} of {t['requests']:,} requests failed."
            )
        st.altair_chart(
            charts.stacked_counts(
                ops,
                y="events",
                color="op",
                colors=charts.OP_COLORS,
                title=f"Events per {timewin.fmt_span(f.bar_bucket_s)} by operation",
                y_title="events",
            ),
            width="stretch",
        )
        total, trace = kv.alloc_trace(f)
        if len(trace) < total:
            st.caption(
                f"Event timeline: the newest {len(trace):,} of {total:,} events in the window; narrow the "
                "time range to see every event."
            )
        else:
            st.caption(f"Event timeline: all {total:,} events in the window.")
        st.altair_chart(
            charts.alloc_timeline(trace, title="Allocation events (hover for request and blocks)"), width="stretch"
        )
        with st.expander("Event table"):
            show(
                trace,
                {
                    "time": Col("Time", "clock"),
                    "instance": Col("Instance"),
                    "run_id": Col("Run", width="medium"),
                    "op": Col("Operation"),
                    "tier": Col("Tier"),
                    "request_id": Col("Request", width="medium"),
                    "blocks": Col("Blocks", "count"),
                    "block_size": Col("Block size", "count", help="tokens per block"),
                    "bytes": Col("Bytes", "bytes"),
                    "usage_after": Col("Usage after", "percent", help="hot-tier usage after the event"),
                },
            )
