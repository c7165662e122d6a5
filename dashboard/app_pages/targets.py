"""Targets: the Prometheus endpoints the collector scrapes, whether each is up, and how long scrapes take."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import charts, timewin, ui
from dashboard.data import catalog, serving
from dashboard.tables import Col, show

st.title("Targets")
f = ui.current_filters()
ui.page_caption("Scrape targets as the collector's scraper last saw them; history in " + ui.window_text() + ".")
now = time.time()

with ui.guarded("Scrape targets"):
    targets = catalog.targets(f.db_url)
    if targets.empty:
        st.info(
            "**No scrape targets.** Engines that push events need none. To scrape vLLM, SGLang, a DCGM "
            "exporter or a kvpilot engine's /metrics, register it with the collector (administration: its admin "
            "token; a target on this host also needs `KVPILOT_SCRAPE_ALLOW_NETS` on the collector):\n\n"
            '`curl -X POST http://127.0.0.1:8100/v1/targets -H "Authorization: Bearer $KVPILOT_ADMIN_TOKEN" '
            "-H 'content-type: application/json' "
            '-d \'{"url": "http://HOST:8000/metrics", "job": "vllm", "labels": {"node": "HOST"}}\'`',
            icon=":material/info:",
        )
        st.stop()

    def health(row: pd.Series) -> str:
        if not row["enabled"]:
            return "disabled"
        if row["up"] is None or pd.isna(row["up"]):
            return "never scraped"
        if not row["up"]:
            return "down"
        stale = not pd.isna(row["last_scrape_at"]) and now - row["last_scrape_at"] > 3 * row["interval_s"]
        return "stale" if stale else "up"

    targets["health"] = targets.apply(health, axis=1)
    counts = targets["health"].value_counts()
    cols = st.columns(4)
    cols[0].metric("Targets", len(targets))
    cols[1].metric("Up", int(counts.get("up", 0)))
    cols[2].metric("Down", int(counts.get("down", 0)))
    cols[3].metric(
        "Stale / never scraped",
        int(counts.get("stale", 0) + counts.get("never scraped", 0)),
        help="stale: no scrape for three intervals (is the collector's scraper running?)",
    )
    down = targets[targets["health"] == "down"]
    for row in down.itertuples():
        st.error(
            f"**{row.job} · {row.instance}** ({row.url}) is down: {row.last_error or 'no error recorded'}",
            icon=":material/cloud_off:",
        )

    # A float column holds a missing time as NaN, not None: "never", not "0 s ago".
    targets["last scrape"] = targets["last_scrape_at"].map(lambda ts: timewin.fmt_ago(None if pd.isna(ts) else ts, now))
    # What a reader scans for first (is it up, since when, why not) before where it is: the table fits its box,
    # so no column hides behind a horizontal scroll.
    show(
        targets,
        {
            "health": Col("Health"),
            "job": Col("Job", width="small"),
            "instance": Col("Instance"),
            "last scrape": Col("Last scrape", width="small"),
            "scrape_duration_s": Col("Took", "seconds", width="small", help="the last scrape"),
            "interval_s": Col("Interval", "seconds", width="small"),
            "last_error": Col("Last error", width="medium"),
            "labels": Col("Labels", width="small", help="static target labels, added to every series"),
            "url": Col("URL", "link", width="medium"),
            "sample_limit": Col("Sample limit", "count", width="small", help="samples a scrape may keep"),
            "id": Col("Id", "count", width="small"),
        },
    )

st.subheader("Scrape history")
with ui.guarded("Scrape history"):
    history = serving.gauges(f, ("up", "scrape_duration_seconds"))
    if history.empty:
        ui.empty("scrapes", "The collector's scraper records `up` and the scrape duration each interval.")
    else:
        left, right = st.columns(2)
        up = history[history["series"] == "up"]
        dur = history[history["series"] == "scrape_duration_seconds"]
        if not up.empty:
            left.altair_chart(
                charts.lines(
                    up,
                    y="value",
                    color="instance",
                    y_title="up",
                    percent=True,
                    title="Up (share of scrapes that succeeded)",
                ),
                width="stretch",
            )
        if not dur.empty:
            right.altair_chart(
                charts.lines(
                    dur, y="value", color="instance", title="Scrape duration", y_title="seconds", y_format=".3~g"
                ),
                width="stretch",
            )
