"""Alerts: what fires or is pending now, what resolved, the rules and their thresholds, notifications, silences."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import alert_views, charts, settings, timewin, transform, ui
from dashboard.data import alerting
from dashboard.tables import Col, show

st.title("Alerts")
f = ui.current_filters()
ui.page_caption(
    "Alert state as the evaluator last wrote it; notifications in "
    + ui.window_text()
    + (" and since, up to now." if ui.follows_present() else ".")
)
NO_EVALUATOR = (
    "Alert state is written by the evaluator: run `kvpilot alerts run --webhook URL` (or `--sink-port "
    "9095` for a local sink) against this database."
)

states = pd.DataFrame(columns=alerting.STATE_COLUMNS)
silence_rows: list[dict] = []
held: alerting.Lease | None = None
now = time.time()
live = True  # until the lease says otherwise (an unreadable database is said by the guard, not as "no evaluator")
with ui.guarded("Alert state"):
    states = alerting.alert_states(f.db_url)
    held = alerting.lease(f.db_url)
    live = alerting.evaluating(held, now)
    if not live:
        last = (
            f" (last held by `{held.holder}`, "
            + (f"expired {timewin.fmt_ago(held.expires_at, now)})" if held.expires_at > 0 else "released)")
            if held is not None and held.holder
            else ""
        )
        st.warning(
            f"**No evaluator holds the lease**{last}: nothing evaluates the rules now. {NO_EVALUATOR}",
            icon=":material/warning:",
        )
with ui.guarded("Silences"):
    silence_rows = alerting.silences(f.db_url)
active_matchers = [s["matchers"] for s in silence_rows if s["status"]["state"] == "active"]
states = states[states["instance"].map(f.shows)] if not states.empty else states
if f.picked:
    st.caption(f"Alerts of {', '.join(f.instances or ())} and fleet-wide ones; clear the instance filter to see all.")
elif f.hidden:
    st.caption(f"Alerts of simulated instances ({', '.join(f.hidden)}) are left out (sidebar).")

states = states.assign(
    silenced=states["labels"].map(lambda labels: any(transform.matches(m, labels) for m in active_matchers)),
    labels=states["labels"].map(lambda d: " · ".join(f"{k}={v}" for k, v in sorted(d.items()))),
)
firing = states[states["state"] == "firing"]
pending = states[states["state"] == "pending"]
resolved = states[states["state"] == "resolved"]
rule_table = pd.DataFrame()
rule_paths = [str(p) for p in settings.load().rule_paths()]
with ui.guarded("Rules"):
    rule_table = alerting.rules(tuple(rule_paths))

cols = st.columns(5)
cols[0].metric("Firing", len(firing))
cols[1].metric("Pending", len(pending))
cols[2].metric("Resolved", len(resolved), help="resolved alerts the evaluator still keeps (about 15 minutes)")
cols[3].metric("Active silences", len(active_matchers))
cols[4].metric("Rules", len(rule_table), help="in the rule files listed under Rules")

STATE_TABLE = {
    "state": Col("State"),
    "alertname": Col("Alert", width="medium"),
    "severity": Col("Severity"),
    "instance": Col("Instance", width="medium"),
    "summary": Col("Summary", width="medium"),
    "value": Col("Value", "number", help="the expression's value at the last evaluation"),
    "silenced": Col("Silenced", "bool"),
    "active_at": Col("Active since", "time"),
    "fired_at": Col("Firing since", "time"),
    "resolved_at": Col("Resolved at", "time"),
    "labels": Col("Labels", width="medium"),
}

st.subheader("Firing and pending")
active = pd.concat([firing, pending])
if active.empty and live and held is not None:
    st.success(
        f"No alerts are pending or firing (evaluator `{held.holder}` holds the lease).", icon=":material/check_circle:"
    )
elif active.empty:
    st.info("**No alerts are pending or firing** in the state the last evaluator left.", icon=":material/info:")
else:
    show(active, {k: c for k, c in STATE_TABLE.items() if k != "resolved_at"})
if not states.empty:
    spans = []
    for r in states.itertuples():
        name = f"{r.alertname} · {r.instance}" if r.instance else r.alertname
        # Up to the last evaluation: what the evaluator last saw, not what it would see if it ran now.
        end = r.resolved_at if r.resolved_at is not None and not pd.isna(r.resolved_at) else r.last_eval_at
        fired = r.fired_at if r.fired_at is not None and not pd.isna(r.fired_at) else None
        spans.append({"alert": name, "phase": "pending", "from": r.active_at, "to": fired or end})
        if fired:
            spans.append({"alert": name, "phase": "firing", "from": fired, "to": end})
    gantt = pd.DataFrame(spans)
    for c in ("from", "to"):
        gantt[c] = pd.to_datetime(gantt[c], unit="s", utc=True)
    st.altair_chart(
        charts.alert_timeline(gantt, title="Pending and firing intervals (to the last evaluation)"), width="stretch"
    )

st.subheader("Resolved")
if resolved.empty:
    st.caption("No alert resolved recently (the evaluator keeps a resolved alert about 15 minutes).")
else:
    show(resolved.sort_values("resolved_at", ascending=False), {k: c for k, c in STATE_TABLE.items() if k != "state"})

st.subheader("Rules")
with ui.guarded("Rules"):
    if rule_table.empty:
        raise alerting.DataUnavailable(f"No alert rules in {', '.join(rule_paths)}.")
    counts = states.groupby(["alertname", "state"]).size()

    def rule_state(name: str) -> str:
        found = {s: int(counts.get((name, s), 0)) for s in ("firing", "pending", "resolved")}
        text = " · ".join(f"{n} {s}" for s, n in found.items() if n)
        return text or "inactive"

    listing = rule_table.assign(state=rule_table["rule"].map(rule_state))
    unknown = sorted(set(states["alertname"]) - set(rule_table["rule"]))
    show(
        listing,
        {
            "state": Col("State", help="alerts of the rule the evaluator keeps now"),
            "rule": Col("Rule", width="medium"),
            "fires when": Col("Threshold", width="medium", help="the comparisons in the expression; '…': and more"),
            "for": Col("For", help="how long the condition must hold before the alert fires"),
            "severity": Col("Severity"),
            "expr": Col("Expression", width="large"),
            "file": Col("File"),
        },
    )
    st.caption(
        f"Rules in {', '.join(f'`{p}`' for p in rule_paths)} (`KVPILOT_DASHBOARD_RULE_FILES`: list the files "
        "the evaluator runs with, `kvpilot alerts run --rules`)."
        + (f" Alerts of rules not in these files: {', '.join(unknown)}." if unknown else "")
    )

st.subheader("Notification history")
with ui.guarded("Notification history"):
    # A window that reaches the present (a preset, 'Whole run') lists what was notified up to now: a page
    # sent after the last event (an engine that went quiet, then down) belongs here.
    history = alerting.alert_history(f.db_url, f.start, max(f.end, now) if ui.follows_present() else f.end)
    history = history[history["instance"].map(f.shows)]
    if history.empty:
        ui.empty(
            "notifications",
            "Notifications are sent when an alert has fired for its `for` duration and its "
            "route's group_wait has passed.",
        )
    else:
        show(
            history.sort_values("notified_at", ascending=False),
            {
                "notified_at": Col("Notified at", "time"),
                "alertname": Col("Alert", width="medium"),
                "status": Col("Status"),
                "severity": Col("Severity"),
                "instance": Col("Instance", width="medium"),
                "summary": Col("Summary", width="large"),
                "starts_at": Col("Started", "time"),
                "ends_at": Col("Ended", "time"),
                "receiver": Col("Receiver"),
                "delivery": Col("Delivery"),
                "notification_id": Col("Notification", "count"),
            },
        )

st.subheader("Deliveries")
with ui.guarded("Deliveries"):
    alert_views.deliveries(alerting.deliveries(f.db_url))

st.subheader("Silences")
with ui.guarded("Silences"):
    alert_views.render(f.db_url, silence_rows, firing)
