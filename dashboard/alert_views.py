"""The Alerts page's delivery log and silences: tables, and the two writes, for a signed-in user only."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import auth, transform
from dashboard.data import alerting
from dashboard.tables import Col, show

DELIVERY_TABLE = {
    "id": Col("Notification", "count"),
    "receiver": Col("Receiver"),
    "kind": Col("Kind"),
    "status": Col("Status"),
    "attempts": Col("Attempts", "count"),
    "created_at": Col("Created", "time"),
    "delivered_at": Col("Delivered", "time"),
    "next_attempt_at": Col("Next attempt", "time"),
    "last_error": Col("Last error", width="large"),
}
ATTEMPT_TABLE = {
    "attempt": Col("Attempt", "count"),
    "started_at": Col("Started", "clock"),
    "duration_s": Col("Took", "seconds"),
    "http_status": Col("HTTP status", "count"),
    "outcome": Col("Outcome"),
    "error": Col("Error", width="large"),
}
SILENCE_TABLE = {
    "state": Col("State"),
    "matchers": Col("Matchers", width="large"),
    "starts": Col("Starts", "time"),
    "ends": Col("Ends", "time"),
    "created by": Col("Created by"),
    "comment": Col("Comment", width="large"),
    "id": Col("Id"),
}


def deliveries(rows: list[dict[str, Any]]) -> None:
    """The outbox: one row per notification, and the HTTP attempts of one of them."""
    if not rows:
        st.info(
            "**No notifications in the outbox.** Deliveries appear here with every HTTP attempt once the "
            "evaluator notifies a receiver.",
            icon=":material/info:",
        )
        return
    table = pd.DataFrame([{k: r.get(k) for k in DELIVERY_TABLE} for r in rows])
    st.caption(" · ".join(f"{status}: {n}" for status, n in table["status"].value_counts().items()))
    show(table, DELIVERY_TABLE)
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
        show(pd.DataFrame(attempt_log), ATTEMPT_TABLE)
    else:
        st.caption("Not attempted yet.")


def render(db_url: str, silence_rows: list[dict[str, Any]], firing: pd.DataFrame) -> None:
    """The silences, expiring one and creating one (both need a signed-in user: dashboard.auth)."""
    user = auth.writer()
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
        show(listing, SILENCE_TABLE)
        live = [s for s in silence_rows if s["status"]["state"] != "expired"]
        if live:
            _expire(db_url, live, user)
    else:
        st.caption("No silences yet.")
    _create(db_url, firing, user)


def _expire(db_url: str, live: list[dict[str, Any]], user: str | None) -> None:
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
    clicked = c2.button("Expire", key="silence_expire", icon=":material/timer_off:", disabled=user is None)
    if user is None:
        auth.need_writer("expire a silence")
    elif clicked:
        if alerting.expire_silence(db_url, target, user=user):
            st.toast(f"Silence {target[:8]} expired.")
            st.rerun()
        else:
            st.warning("That silence no longer exists.")


def _create(db_url: str, firing: pd.DataFrame, user: str | None) -> None:
    with st.form("silence_form", clear_on_submit=False):
        st.markdown("**New silence** — alerts matching every matcher are not notified (Alertmanager's rules).")
        default = f"alertname={firing.iloc[0]['alertname']}" if not firing.empty else ""
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
        c2.text_input("Created by", value=user or "(sign in)", disabled=True, help="the signed-in user")
        comment = st.text_input("Comment", key="silence_comment", placeholder="why, and a ticket if there is one")
        submitted = st.form_submit_button("Create silence", icon=":material/notifications_off:", disabled=user is None)
        if user is None:
            auth.need_writer("create a silence")
        elif submitted:
            try:
                sid = alerting.create_silence(
                    db_url,
                    matchers=matcher_lines.splitlines(),
                    duration_s=hours * 3600,
                    created_by=user,
                    comment=comment,
                )
            except ValueError as exc:
                st.error(f"Silence not created: {exc}")
            else:
                st.toast(f"Silence {sid[:8]} created.")
                st.rerun()
