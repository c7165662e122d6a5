"""Alert state, notifications and silences, read and written through the alerts package's own functions."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import streamlit as st

from alerts.delivery import list_notifications
from alerts.silences import SilenceIn, list_silences, parse_matcher
from alerts.silences import create_silence as store_silence
from alerts.silences import expire_silence as expire_stored_silence
from alerts.state import INACTIVE
from alerts.store import load_states, notification_bodies
from collector.db import session_factory, session_scope
from dashboard.data.base import TTL_S, engine

STATE_COLUMNS = [
    "alertname",
    "state",
    "severity",
    "instance",
    "summary",
    "value",
    "active_at",
    "fired_at",
    "resolved_at",
    "last_eval_at",
    "labels",
    "fingerprint",
]
HISTORY_COLUMNS = [
    "notified_at",
    "alertname",
    "status",
    "severity",
    "instance",
    "summary",
    "starts_at",
    "ends_at",
    "receiver",
    "delivery",
    "notification_id",
]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alert_states(url: str) -> pd.DataFrame:
    """Current alert rows: pending, firing, and resolved within the evaluator's retention (oldest first)."""
    with session_scope(session_factory(engine(url))) as session:
        stored = [a for by_fp in load_states(session).values() for a in by_fp.values()]
    stored.sort(key=lambda a: (a.active_at, a.rule, a.fingerprint))
    data = [
        {
            "alertname": a.rule,
            "state": "resolved" if a.state == INACTIVE else a.state,
            "severity": a.labels.get("severity", ""),
            "instance": a.labels.get("instance", ""),
            "summary": a.annotations.get("summary", ""),
            "value": a.value,
            "active_at": a.active_at,
            "fired_at": a.fired_at,
            "resolved_at": a.resolved_at,
            "last_eval_at": a.last_eval_at,
            "labels": dict(a.labels),
            "fingerprint": a.fingerprint,
        }
        for a in stored
    ]
    return pd.DataFrame(data, columns=STATE_COLUMNS)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def deliveries(url: str, limit: int = 200) -> list[dict[str, Any]]:
    """Notifications with their attempts (alerts.delivery), newest first, each with the body it sent."""
    with session_scope(session_factory(engine(url))) as session:
        rows = list_notifications(session, limit=limit)
        bodies = notification_bodies(session, [r["id"] for r in rows])
    for row in rows:
        row["body"] = bodies.get(row["id"], "")
    return rows


def alert_history(url: str, start: float, end: float) -> pd.DataFrame:
    """What was notified in the window, one row per alert per notification (newest first)."""
    from dashboard.transform import alerts_in_notification

    rows = [
        a
        for n in deliveries(url, limit=1000)
        if start <= n["created_at"] < end
        for a in alerts_in_notification(n, n["body"])
    ]
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def silences(url: str) -> list[dict[str, Any]]:
    with session_scope(session_factory(engine(url))) as session:
        return list_silences(session, now=time.time(), include_expired=True)


def create_silence(
    url: str, *, matchers: list[str], duration_s: float, created_by: str, comment: str, starts_at: float | None = None
) -> str:
    """Parse amtool-style matchers and store a silence through alerts.silences; ValueError names a bad input."""
    now = time.time()
    start = now if starts_at is None else starts_at
    parsed = [parse_matcher(m) for m in matchers if m.strip()]
    if not parsed:
        raise ValueError("a silence needs at least one matcher, e.g. alertname=KvCacheNearlyFull")
    silence = SilenceIn(
        matchers=parsed, startsAt=start, endsAt=start + duration_s, createdBy=created_by, comment=comment
    )
    with session_scope(session_factory(engine(url))) as session:
        silence_id = store_silence(session, silence, now=now)
    silences.clear()
    return silence_id


def expire_silence(url: str, silence_id: str) -> bool:
    with session_scope(session_factory(engine(url))) as session:
        found = expire_stored_silence(session, silence_id, now=time.time())
    silences.clear()
    return found
