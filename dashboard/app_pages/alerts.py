"""Alerts: what is firing or pending now, what was notified, how deliveries went, and silences to manage."""

from __future__ import annotations

import getpass
import time

import pandas as pd
import streamlit as st

from dashboard import charts, transform, ui
from dashboard.data import alerting

st.title("Alerts")
f = ui.current_filters()
now = time.time()
NO_EVALUATOR = (
    "Alert state is written by the evaluator: run `kvpilot alerts run --webhook URL` (or `--sink-port "
    "9095` for a local sink) against this database."
)

states = pd.DataFrame()
silence_rows: list[dict] = []
with ui.guarded("Alert state"):
    states = alerting.alert_states(f.db_url)
with ui.guarded("Silences"):
    silence_rows = alerting.silences(f.db_url)
active_matchers = [s["matchers"] for s in silence_rows if s["status"]["state"] == "active"]
if f.instances is not None and not states.empty:
    # Alerts of the selected instances, and those without an instance label (fleet-wide rules).
    states = states[states["instance"].isin(f.instances) | (states["instance"] == "")]
    st.caption(f"Alerts of {', '.join(f.instances)} and fleet-wide ones; clear the instance filter to see all.")


def _silenced(labels: dict) -> bool:
    return any(transform.matches(m, labels) for m in active_matchers)


firing = states[states["state"] == "firing"] if not states.empty else states
pending = states[states["state"] == "pending"] if not states.empty else states
cols = st.columns(4)
cols[0].metric("Firing", len(firing))
cols[1].metric("Pending", len(pending))
cols[2].metric("Resolved (last 15 min)", int((states["state"] == "resolved").sum()) if not states.empty else 0)
cols[3].metric("Active silences", len(active_matchers))

st.subheader("Firing and pending")
if states.empty:
    st.info(f"**No alerts are pending or firing.** {NO_EVALUATOR}", icon=":material/info:")
else:
    view = states.copy()
    view["silenced"] = view["labels"].map(_silenced)
    view["active since"] = pd.to_datetime(view["active_at"], unit="s", utc=True)
    view["firing since"] = pd.to_datetime(view["fired_at"], unit="s", utc=True)
    view["resolved at"] = pd.to_datetime(view["resolved_at"], unit="s", utc=True)
    view["labels"] = view["labels"].map(lambda d: ", ".join(f"{k}={v}" for k, v in sorted(d.items())))
    order = {"firing": 0, "pending": 1, "resolved": 2}
    view = view.sort_values("state", key=lambda s: s.map(order))
    st.dataframe(
        view[
            [
                "state",
                "alertname",
                "severity",
                "instance",
                "summary",
                "value",
                "silenced",
                "active since",
                "firing since",
                "resolved at",
                "labels",
            ]
        ],
        hide_index=True,
        width="stretch",
        column_config={
            c: st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")
            for c in ("active since", "firing since", "resolved at")
        },
    )
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

st.subheader("Notification history")
with ui.guarded("Notification history"):
    history = alerting.alert_history(f.db_url, f.start, f.end)
    if history.empty:
        ui.empty(
            "notifications",
            "Notifications are sent when an alert has fired for its `for` duration and its "
            "route's group_wait has passed.",
        )
    else:
        for c in ("notified_at", "starts_at", "ends_at"):
            history[c] = pd.to_datetime(history[c], unit="s", utc=True)
        st.dataframe(
            history.sort_values("notified_at", ascending=False),
            hide_index=True,
            width="stretch",
            column_config={
                c: st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")
                for c in ("notified_at", "starts_at", "ends_at")
            },
        )

st.subheader("Deliveries")
with ui.guarded("Deliveries"):
    rows = alerting.deliveries(f.db_url)
    if not rows:
        st.info(
            "**No notifications in the outbox.** Deliveries appear here with every HTTP attempt once the "
            "evaluator notifies a receiver.",
            icon=":material/info:",
        )
    else:
        table = pd.DataFrame(
            [
                {
                    k: r[k]
                    for k in (
                        "id",
                        "receiver",
                        "kind",
                        "status",
                        "attempts",
                        "created_at",
                        "delivered_at",
                        "next_attempt_at",
                        "last_error",
                    )
                }
                for r in rows
            ]
        )
        for c in ("created_at", "delivered_at", "next_attempt_at"):
            table[c] = pd.to_datetime(table[c], unit="s", utc=True)
        counts = table["status"].value_counts()
        st.caption(" · ".join(f"{status}: {n}" for status, n in counts.items()))
        st.dataframe(
            table,
            hide_index=True,
            width="stretch",
            column_config={
                c: st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss")
                for c in ("created_at", "delivered_at", "next_attempt_at")
            },
        )
        chosen = st.selectbox(
            "Attempts of delivery",
            options=[r["id"] for r in rows],
            key="delivery_pick",
            format_func=lambda i: next(
                f"#{r['id']} → {r['receiver']} ({r['status']}, {r['attempts']} attempts)" for r in rows if r["id"] == i
            ),
        )
        attempt_log = next(r["attempt_log"] for r in rows if r["id"] == chosen)
        if attempt_log:
            log = pd.DataFrame(attempt_log)
            log["started_at"] = pd.to_datetime(log["started_at"], unit="s", utc=True)
            st.dataframe(
                log,
                hide_index=True,
                width="stretch",
                column_config={
                    "started_at": st.column_config.DatetimeColumn(format="HH:mm:ss.SSS"),
                    "duration_s": st.column_config.NumberColumn(format="%.3f"),
                },
            )
        else:
            st.caption("Not attempted yet.")

st.subheader("Silences")
with ui.guarded("Silences"):
    if silence_rows:
        listing = pd.DataFrame(
            [
                {
                    "state": s["status"]["state"],
                    "matchers": transform.matcher_text(s["matchers"]),
                    "starts": s["startsAt"],
                    "ends": s["endsAt"],
                    "created by": s["createdBy"],
                    "comment": s["comment"],
                    "id": s["id"],
                }
                for s in silence_rows
            ]
        )
        for c in ("starts", "ends"):
            listing[c] = pd.to_datetime(listing[c], unit="s", utc=True)
        st.dataframe(
            listing,
            hide_index=True,
            width="stretch",
            column_config={
                c: st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss") for c in ("starts", "ends")
            },
        )
        live = [s for s in silence_rows if s["status"]["state"] != "expired"]
        if live:
            c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
            target = c1.selectbox(
                "Silence to expire",
                options=[s["id"] for s in live],
                key="silence_expire_pick",
                format_func=lambda i: next(
                    f"{transform.matcher_text(s['matchers'])} ({s['status']['state']}, id {i[:8]})"
                    for s in live
                    if s["id"] == i
                ),
            )
            if c2.button("Expire", key="silence_expire", icon=":material/timer_off:"):
                if alerting.expire_silence(f.db_url, target):
                    st.toast(f"Silence {target[:8]} expired.")
                    st.rerun()
                else:
                    st.warning("That silence no longer exists.")
    else:
        st.caption("No silences yet.")

    with st.form("silence_form", clear_on_submit=False):
        st.markdown("**New silence** — alerts matching every matcher are not notified (Alertmanager's rules).")
        default = ""
        if not firing.empty:
            default = f"alertname={firing.iloc[0]['alertname']}"
        matcher_lines = st.text_area(
            "Matchers, one per line",
            value=default,
            key="silence_matchers",
            help='name=value, name!=value, name=~"regex", name!~"regex"',
        )
        c1, c2 = st.columns(2)
        hours = c1.number_input(
            "Duration (hours)", min_value=0.05, max_value=24.0 * 90, value=2.0, step=0.5, key="silence_hours"
        )
        author = c2.text_input("Created by", value=getpass.getuser(), key="silence_author")
        comment = st.text_input("Comment", key="silence_comment", placeholder="why, and a ticket if there is one")
        if st.form_submit_button("Create silence", icon=":material/notifications_off:"):
            try:
                sid = alerting.create_silence(
                    f.db_url,
                    matchers=matcher_lines.splitlines(),
                    duration_s=hours * 3600,
                    created_by=author,
                    comment=comment,
                )
            except ValueError as exc:
                st.error(f"Silence not created: {exc}")
            else:
                st.toast(f"Silence {sid[:8]} created.")
                st.rerun()
