"""KV memory: how full each tier is, how much of it is wasted, and the allocation trace that got it there."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, ui
from dashboard.data import catalog, kv, scraped, serving

st.title("KV memory")
f = ui.current_filters()
sel = catalog.selection(f)
st.caption(f"KV cache samples, scrapes and allocation events in {ui.window_text()}.")

NO_SAMPLES = (
    "KV gauges come from engine sample events (kvpilot engines send them every telemetry interval) or "
    "from scraping vLLM/SGLang; widen the time range or clear the filters."
)
PUSH_ONLY = (
    "kvpilot's engine push (`telemetry.sink: http`; `telemetry.trace_alloc` for the trace): vLLM and SGLang "
    "expose only their KV usage",
)

with ui.guarded("KV usage"):
    usage = kv.usage(f)
    if usage.empty:
        if not sel.scraped:
            ui.empty("KV samples", NO_SAMPLES)
    else:
        mean = usage.groupby("series")["value"].mean()
        cols = st.columns(4)
        for col, name in zip(cols, kv.KV_SERIES.values(), strict=True):
            peak = usage[usage["series"] == name]["value"].max() if name in mean.index else None
            col.metric(
                f"{name.capitalize()} (mean)",
                ui.fmt_pct(mean.get(name)),
                help="average of the bucket averages in the window; peak is the highest bucket",
            )
            col.caption(f"peak {ui.fmt_pct(peak)}")
        tiers = usage[usage["series"].isin(["hot tier usage", "cold tier usage"])].copy()
        st.altair_chart(
            charts.lines(
                tiers,
                y="value",
                color="instance",
                dash="series",
                y_title="used",
                percent=True,
                title="Hot (device) and cold (host) tier usage",
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
                    title="Internal waste (allocated slots holding no token) and external "
                    "fragmentation (free memory unusable for a block)",
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
                        title="KV cache usage per engine (peak per bucket)",
                    ),
                    width="stretch",
                )
            st.dataframe(
                engines.drop(columns=["queue depth", "running", "swapped"], errors="ignore"),
                hide_index=True,
                width="stretch",
                column_config={
                    c: st.column_config.ProgressColumn(min_value=0.0, max_value=1.0, format="percent")
                    for c in ("KV usage", "cold KV usage", "prefix hit rate", "KV peak")
                }
                | {"newest": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")},
            )
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
                title="Accelerator memory per GPU (peak per bucket)",
                y_title="used",
                percent=True,
                threshold=(scraped.MEMORY_PRESSURE, "MemoryPressure"),
            ),
            width="stretch",
        )

left, right = st.columns(2)
with left, ui.guarded("Swap rate"):
    swaps = serving.gauges(f, ("swap_rate",))
    if swaps.empty:
        ui.empty("swap-rate samples", "Swapping starts when the hot tier runs out; none sampled means none seen.")
    else:
        st.altair_chart(
            charts.lines(swaps, y="value", color="line", title="Swap rate", y_title="swaps/s", y_format=".3~g"),
            width="stretch",
        )
with right, ui.guarded("Prefix-cache hit rate"):
    hits = serving.gauges(f, ("prefix_hit_rate",))
    if hits.empty:
        ui.empty("prefix-cache samples", "Enable the prefix cache (`cache.enable_prefix_cache: true`) to see it.")
    else:
        st.altair_chart(
            charts.lines(
                hits, y="value", color="line", title="Prefix-cache hit rate", y_title="hit rate", percent=True
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
            ui.empty("allocation events", "Engines send alloc/free/swap/evict events when telemetry.trace_alloc is on.")
    else:
        totals = ops.groupby("op")[["events", "blocks"]].sum()
        cols = st.columns(len(totals))
        for col, (op, row) in zip(cols, totals.iterrows(), strict=True):
            col.metric(op, f"{int(row['events']):,}", help=f"{int(row['blocks']):,} blocks")
        st.altair_chart(
            charts.stacked_counts(
                ops,
                y="events",
                color="op",
                colors=charts.OP_COLORS,
                title=f"Events per {ui.fmt_s(f.bar_bucket_s)} bucket by operation",
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
            st.dataframe(
                trace.drop(columns=["ts"]),
                hide_index=True,
                width="stretch",
                column_config={
                    "usage_after": st.column_config.NumberColumn(format="percent"),
                    "time": st.column_config.DatetimeColumn(format="HH:mm:ss.SSS"),
                },
            )
