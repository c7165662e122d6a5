"""KV memory: how full each tier is, how much of it is wasted, and the allocation trace that got it there."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, ui

st.title("KV memory")
f = ui.current_filters()
st.caption(f"KV cache samples and allocation events in {ui.window_text()}.")

NO_SAMPLES = (
    "KV gauges come from engine sample events (kvpilot engines send them every telemetry interval) or "
    "from scraping vLLM/SGLang; widen the time range or clear the filters."
)

with ui.guarded("KV usage"):
    kv = data.kv_memory(f)
    if kv.empty:
        ui.empty("KV samples", NO_SAMPLES)
    else:
        mean = kv.groupby("series")["value"].mean()
        cols = st.columns(4)
        for col, name in zip(
            cols, ("hot tier usage", "cold tier usage", "internal waste", "external fragmentation"), strict=True
        ):
            peak = kv[kv["series"] == name]["value"].max() if name in mean.index else None
            col.metric(
                f"{name.capitalize()} (mean)",
                ui.fmt_pct(mean.get(name)),
                help="average of the bucket averages in the window; peak is the highest bucket",
            )
            col.caption(f"peak {ui.fmt_pct(peak)}")
        tiers = kv[kv["series"].isin(["hot tier usage", "cold tier usage"])].copy()
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
        waste = kv[kv["series"].isin(["internal waste", "external fragmentation"])].copy()
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

left, right = st.columns(2)
with left, ui.guarded("Swap rate"):
    swaps = data.gauges(f, ("swap_rate",))
    if swaps.empty:
        ui.empty("swap-rate samples", "Swapping starts when the hot tier runs out; none sampled means none seen.")
    else:
        st.altair_chart(
            charts.lines(swaps, y="value", color="instance", title="Swap rate", y_title="swaps/s", y_format=".3~g"),
            width="stretch",
        )
with right, ui.guarded("Prefix-cache hit rate"):
    hits = data.gauges(f, ("prefix_hit_rate",))
    if hits.empty:
        ui.empty("prefix-cache samples", "Enable the prefix cache (`cache.enable_prefix_cache: true`) to see it.")
    else:
        st.altair_chart(
            charts.lines(
                hits, y="value", color="instance", title="Prefix-cache hit rate", y_title="hit rate", percent=True
            ),
            width="stretch",
        )

st.subheader("Allocation trace")
with ui.guarded("Allocation trace"):
    ops = data.alloc_ops(f)
    if ops.empty:
        ui.empty("allocation events", "Engines send alloc/free/swap/evict events when telemetry.alloc_events is on.")
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
        total, trace = data.alloc_trace(f)
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
