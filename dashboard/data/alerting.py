"""Alert state, notifications and silences, read and written through the alerts package's own functions."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from alerts.delivery import list_notifications
from alerts.silences import SilenceIn, list_silences, parse_matcher
from alerts.silences import create_silence as store_silence
from alerts.silences import expire_silence as expire_stored_silence
from alerts.state import INACTIVE
from alerts.store import Lease, load_states, notification_bodies, read_lease
from collector.db import session_factory, session_scope
from dashboard.data.base import TTL_S, DataUnavailable, engine

log = logging.getLogger("kvpilot.dashboard")

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
def lease(url: str) -> Lease | None:
    """The evaluator lease as stored (None: no evaluator ever ran against this database)."""
    return read_lease(session_factory(engine(url)))


def evaluating(held: Lease | None, now: float) -> bool:
    """Whether an evaluator holds the lease now: only then is the alert state current (one that stopped
    released it, one that died lets it expire)."""
    return held is not None and bool(held.holder) and held.expires_at >= now


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
    """Parse amtool-style matchers and store a silence through alerts.silences; ValueError names a bad input.

    `created_by` is the signed-in user (dashboard.auth), not a name the visitor typed.
    """
    if not created_by:
        raise PermissionError("creating a silence needs a signed-in user")
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
    log.info("silence %s created by %s (dashboard)", silence_id, created_by)
    return silence_id


def expire_silence(url: str, silence_id: str, *, user: str) -> bool:
    if not user:
        raise PermissionError("expiring a silence needs a signed-in user")
    with session_scope(session_factory(engine(url))) as session:
        found = expire_stored_silence(session, silence_id, now=time.time())
    silences.clear()
    if found:
        log.info("silence %s expired by %s (dashboard)", silence_id, user)
    return found


RULE_COLUMNS = ["rule", "group", "expr", "fires when", "for_s", "severity", "summary", "file", "thresholds"]


@st.cache_data(ttl=60, show_spinner=False)
def rules(paths: tuple[str, ...]) -> pd.DataFrame:
    """The alert rules of the configured rule files (alerts.rules), one row each with its thresholds.

    DataUnavailable says which file is broken and how (the evaluator would refuse it the same way).
    """
    from alerts.durations import format_duration
    from alerts.rules import RuleFileError, load_rule_files
    from dashboard.transform import thresholds

    try:
        groups = load_rule_files(list(paths))
    except RuleFileError as exc:
        raise DataUnavailable(f"the rule files do not load: {'; '.join(exc.problems[:3])}") from exc
    rows = []
    for g in groups:
        for r in g.rules:
            found = list(dict.fromkeys(thresholds(r.name, r.expr)))
            rows.append(
                {
                    "rule": r.name,
                    "group": g.name,
                    "expr": " ".join(r.expr_text.split()),
                    "fires when": " or ".join(t.condition for t in found) if found else "",
                    "for_s": r.for_s,
                    "for": format_duration(r.for_s) if r.for_s else "at once",
                    "severity": r.labels.get("severity", ""),
                    "summary": r.annotations.get("summary", ""),
                    "file": f"{Path(g.file).name}",
                    "thresholds": found,
                }
            )
    return pd.DataFrame(rows, columns=[*RULE_COLUMNS, "for"])


def thresholds_for(series: str) -> list[Any]:
    """The thresholds (transform.Threshold) the configured rules put on a canonical series, for its charts."""
    from dashboard import settings

    try:
        table = rules(tuple(str(p) for p in settings.load().rule_paths()))
    except (DataUnavailable, ValueError):
        return []
    found = [t for ts in table["thresholds"] for t in ts if t.series == series]
    return list(dict.fromkeys(found))
