"""Which outbox rows the delivery worker sends next, a group's stale backlog collapsed; the outbox listing.

Per (receiver, group) at most one notification is in flight, oldest first. A claim under this lease's
token is this worker's own from an earlier batch (the worker is one thread), so it may be claimed again.
When a receiver was down and a group queued several notifications meanwhile, the older ones are stale:
each payload is the group's whole state, so the newest says where every alert stands now. An older one is
marked `expired` ("superseded by ...") when every alert it mentions is also in the newest, as Alertmanager
sends only a group's current state after an outage. One that mentions an alert the newest does not (a
resolution already flushed out of the group) is still sent, before the newer ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from alerts.alertmanager import fingerprint
from collector.schema import AlertNotification, AlertNotificationAttempt

SUPERSEDED = "superseded by notification"


def alert_fingerprints(row: AlertNotification) -> frozenset[str] | None:
    """The alerts a notification mentions (None if its body cannot be read: then it is never superseded)."""
    try:
        body = json.loads(row.body)
        if row.kind == "alertmanager":
            return frozenset(fingerprint(a["labels"]) for a in body)
        return frozenset(a["fingerprint"] for a in body["alerts"])
    except (ValueError, TypeError, KeyError):
        return None


def _collapse(rows: list[AlertNotification], now: float) -> list[AlertNotification]:
    """Mark the rows the newest supersedes; returns them."""
    newest = rows[-1]
    current = alert_fingerprints(newest) if len(rows) > 1 else None
    if current is None:
        return []
    superseded = []
    for row in rows[:-1]:
        mentioned = alert_fingerprints(row)
        if mentioned is not None and mentioned <= current:
            row.status = "expired"
            row.last_error = f"{SUPERSEDED} {newest.id} ({newest.idempotency_key}) at {now:.3f}"
            row.claim_token = row.claim_expires_at = None
            superseded.append(row)
    return superseded


def claim_due(
    session: Session,
    *,
    now: float,
    token: int,
    claim_until: float,
    batch: int,
    on_superseded: Callable[[AlertNotification], None],
) -> list[AlertNotification]:
    """Collapse stale backlogs and claim each group's due head (in the caller's fenced transaction)."""
    pending = (
        session.execute(
            select(AlertNotification).where(AlertNotification.status == "pending").order_by(AlertNotification.id)
        )
        .scalars()
        .all()
    )
    groups: dict[tuple[str, str], list[AlertNotification]] = {}
    for row in pending:
        groups.setdefault((row.receiver, row.group_key), []).append(row)
    due: list[AlertNotification] = []
    for rows in groups.values():
        if any(r.claim_token != token and r.claim_expires_at is not None and r.claim_expires_at >= now for r in rows):
            continue  # in flight under an earlier lease (its sender died or lost the lease less than a lease ago)
        for row in _collapse(rows, now):
            on_superseded(row)
        head = next(r for r in rows if r.status == "pending")
        if head.next_attempt_at <= now and len(due) < batch:
            head.claim_token, head.claim_expires_at = token, claim_until
            due.append(head)
    return due


def pending(session: Session) -> bool:
    """Whether any notification waits to be sent (what `claim_due` reads), one index probe."""
    n = AlertNotification.__table__.c
    return session.execute(select(n.id).where(n.status == "pending").limit(1)).first() is not None


def list_notifications(session: Session, *, limit: int = 100, status: str | None = None) -> list[dict]:
    """Deliveries and their attempts, newest first (for the CLI and the dashboard)."""
    stmt = select(AlertNotification).order_by(AlertNotification.id.desc()).limit(limit)
    if status:
        stmt = stmt.where(AlertNotification.status == status)
    rows = session.execute(stmt).scalars().all()
    ids = [r.id for r in rows]
    attempts: dict[int, list[dict]] = {}
    if ids:
        for a in session.execute(
            select(AlertNotificationAttempt)
            .where(AlertNotificationAttempt.notification_id.in_(ids))
            .order_by(AlertNotificationAttempt.id)
        ).scalars():
            attempts.setdefault(a.notification_id, []).append(
                {
                    "attempt": a.attempt,
                    "started_at": a.started_at,
                    "duration_s": a.duration_s,
                    "http_status": a.http_status,
                    "outcome": a.outcome,
                    "error": a.error,
                }
            )
    return [
        {
            "id": r.id,
            "idempotency_key": r.idempotency_key,
            "receiver": r.receiver,
            "kind": r.kind,
            "status": r.status,
            "attempts": r.attempts,
            "created_at": r.created_at,
            "next_attempt_at": r.next_attempt_at,
            "delivered_at": r.delivered_at,
            "last_error": r.last_error,
            "attempt_log": attempts.get(r.id, []),
        }
        for r in rows
    ]
