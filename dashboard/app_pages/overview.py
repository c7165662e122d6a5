"""Overview: is the fleet healthy right now? Traffic, latency, KV and accelerator load, firing alerts, per instance."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, ui

st.title("Overview")
f = ui.current_filters()
st.caption(f"Requests, engine steps and gauges in {ui.window_text()}.")

with ui.guarded("Headline numbers"):
    t = data.totals(f)
    cols = st.columns(6)
    cols[0].metric("Requests", f"{t['requests']:,}", help="requests that left the engine in the window")
    cols[1].metric("Requests/s", f"{t['requests_per_s']:.2f}")
    cols[2].metric("Output tokens/s", ui.fmt_num(t["output_tokens_per_s"]))
    cols[3].metric("TTFT p99", ui.fmt_s(t["ttft_p99"]), help="time to first token, finished requests")
    cols[3].caption(f"p50 {ui.fmt_s(t['ttft_p50'])}")
    cols[4].metric("TPOT p99", ui.fmt_s(t["tpot_p99"]), help="decode time per output token after the first")
    cols[4].caption(f"p50 {ui.fmt_s(t['tpot_p50'])}")
    failed = t["failed"] + t["rejected"] + t["aborted"]
    cols[5].metric("Not finished", f"{failed:,}", help="failed, rejected or aborted requests")
    cols[5].caption(f"{failed / t['requests']:.1%} of requests" if t["requests"] else "no requests")

with ui.guarded("Firing alerts"):
    alerts = data.alert_states(f.db_url)
    active = alerts[alerts["state"].isin(["firing", "pending"])]
    if f.instances is not None:
        active = active[active["instance"].isin(f.instances) | (active["instance"] == "")]
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

st.subheader("Per instance")
with ui.guarded("Per instance"):
    summary = data.instance_summary(f)
    if summary.empty:
        ui.empty(
            "engine data",
            "Start an engine that pushes to the collector (`kvpilot engine serve`), "
            "widen the time range, or clear the instance/run filters.",
        )
    else:
        st.dataframe(
            summary,
            hide_index=True,
            width="stretch",
            column_config={
                "req/s": st.column_config.NumberColumn(format="%.2f"),
                "output tok/s": st.column_config.NumberColumn(format="%.1f"),
                "TTFT p50 (s)": st.column_config.NumberColumn(format="%.4f"),
                "TTFT p99 (s)": st.column_config.NumberColumn(format="%.4f"),
                "e2e p99 (s)": st.column_config.NumberColumn(format="%.3f"),
                "KV usage": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0, format="percent"),
                "utilization": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0, format="percent"),
                "last sample": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss"),
            },
        )

left, right = st.columns(2)
with left, ui.guarded("Throughput"):
    tp = data.throughput(f)
    if tp.empty:
        ui.empty("engine steps", "Step events come from kvpilot engines; scraped servers show gauges only.")
    else:
        long = tp.melt(
            id_vars=["instance", "time"],
            value_vars=["prefill tok/s", "decode tok/s"],
            var_name="kind",
            value_name="tokens/s",
        )
        st.altair_chart(
            charts.lines(
                long, y="tokens/s", color="instance", dash="kind", title="Engine throughput", y_title="tokens/s"
            ),
            width="stretch",
        )
with right, ui.guarded("Queue and running"):
    g = data.gauges(f, ("queue_depth", "running"))
    if g.empty:
        ui.empty("queue samples", "Engines sample queue depth and running sequences every telemetry interval.")
    else:
        g["series"] = g["series"].str.replace("_", " ")
        st.altair_chart(
            charts.lines(
                g,
                y="value",
                color="instance",
                dash="series",
                y_title="requests",
                title="Queue depth and running sequences",
            ),
            width="stretch",
        )

left, right = st.columns(2)
with left, ui.guarded("KV usage"):
    kv = data.gauges(f, ("kv_usage",))
    if kv.empty:
        ui.empty("KV usage samples", "The KV memory page has the full picture once samples arrive.")
    else:
        st.altair_chart(
            charts.lines(
                kv, y="value", color="instance", title="KV cache usage (hot tier)", y_title="used", percent=True
            ),
            width="stretch",
        )
with right, ui.guarded("Utilization"):
    util = data.gauges(f, ("utilization",))
    if util.empty:
        ui.empty("utilization samples", "Engines on CPU report none; on a GPU they sample it, or scrape DCGM.")
    else:
        st.altair_chart(
            charts.lines(
                util, y="value", color="instance", title="Accelerator utilization", y_title="busy", percent=True
            ),
            width="stretch",
        )
