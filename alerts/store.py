"""SQL persistence for alerts: the evaluator lease with its fencing token, and alert state rows.

Lease: one row (id=1). Acquire and renew are a single conditional UPDATE (`holder = me OR expires_at <
now`), which PostgreSQL and SQLite both execute atomically; the token increments whenever the holder
changes. Every write transaction of the evaluator starts with `fence()`, an UPDATE that matches only
while this process still holds the lease with the same token; on PostgreSQL it also row-locks the lease
until COMMIT, on SQLite the write lock does the same. So a process that lost its lease (paused, slow,
partitioned) cannot write a state change or an outbox row: nobody is paged twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from alerts.state import FIRING, PENDING, ActiveAlert
from collector.db import rowcount, translate_errors
from collector.schema import AlertEvaluatorLease, AlertNotification, AlertState

log = logging.getLogger(__name__)
LEASE_ID = 1


class LeaseLostError(RuntimeError):
    """This evaluator no longer holds the lease (or holds it under an older token); the write was refused."""


@dataclass(frozen=True)
class Lease:
    holder: str
    token: int
    expires_at: float


def ensure_lease_row(factory: sessionmaker[Session]) -> None:
    with translate_errors(), factory() as session:
        if session.get(AlertEvaluatorLease, LEASE_ID) is not None:
            return
        session.add(
            AlertEvaluatorLease(id=LEASE_ID, holder="", token=0, expires_at=0.0, acquired_at=0.0, renewed_at=0.0)
        )
        try:
            session.commit()
        except IntegrityError:  # another process inserted it first
            session.rollback()


def try_acquire(factory: sessionmaker[Session], *, holder: str, now: float, ttl_s: float) -> Lease | None:
    """Acquire or renew; None if someone else holds an unexpired lease."""
    lease_t = AlertEvaluatorLease.__table__
    with translate_errors(), factory() as session:
        current = session.execute(
            select(lease_t.c.holder, lease_t.c.expires_at).where(lease_t.c.id == LEASE_ID)
        ).first()
        if current is None:
            raise RuntimeError("alert_evaluator_lease row missing; call ensure_lease_row first")
        if current.holder != holder and current.expires_at >= now:
            return None  # held by another, unexpired: the compare-and-set below could not match
        taking_over = current.holder != holder or current.expires_at < now
        values: dict = {"holder": holder, "expires_at": now + ttl_s, "renewed_at": now}
        if taking_over:
            values["token"] = lease_t.c.token + 1
            values["acquired_at"] = now
        result = session.execute(
            update(lease_t)
            .where(lease_t.c.id == LEASE_ID)
            .where((lease_t.c.holder == holder) | (lease_t.c.expires_at < now))
            .where(lease_t.c.holder == current.holder)  # compare-and-set against what we read
            .values(**values)
        )
        if rowcount(result) != 1:
            session.rollback()
            return None
        token = session.execute(select(lease_t.c.token).where(lease_t.c.id == LEASE_ID)).scalar_one()
        session.commit()
        return Lease(holder, int(token), now + ttl_s)


def release(factory: sessionmaker[Session], lease: Lease) -> None:
    lease_t = AlertEvaluatorLease.__table__
    with translate_errors(), factory() as session:
        session.execute(
            update(lease_t)
            .where(lease_t.c.id == LEASE_ID, lease_t.c.holder == lease.holder, lease_t.c.token == lease.token)
            .values(expires_at=0.0)
        )
        session.commit()


def fence(session: Session, lease: Lease, now: float) -> None:
    """First statement of every evaluator write transaction; raises LeaseLostError if superseded."""
    _fenced_update(session, lease, now, renewed_at=now)


def _fenced_update(session: Session, lease: Lease, now: float, **values: float) -> None:
    """Set `values` on the lease row only while `lease` still holds it; raises LeaseLostError if superseded."""
    lease_t = AlertEvaluatorLease.__table__
    result = session.execute(
        update(lease_t)
        .where(
            lease_t.c.id == LEASE_ID,
            lease_t.c.holder == lease.holder,
            lease_t.c.token == lease.token,
            lease_t.c.expires_at >= now,
        )
        .values(**values)
    )
    if rowcount(result) != 1:
        raise LeaseLostError(f"lease lost by {lease.holder} (token {lease.token})")


def renew(session: Session, lease: Lease, now: float, ttl_s: float) -> Lease:
    """`fence` that also extends the lease to `now + ttl_s`: what the delivery worker runs right before a POST,
    so the POST happens under a lease that outlives its timeout. Raises LeaseLostError if superseded."""
    _fenced_update(session, lease, now, renewed_at=now, expires_at=now + ttl_s)
    return Lease(lease.holder, lease.token, now + ttl_s)


def read_lease(factory: sessionmaker[Session]) -> Lease | None:
    with translate_errors(), factory() as session:
        row = session.get(AlertEvaluatorLease, LEASE_ID)
        return None if row is None else Lease(row.holder, row.token, row.expires_at)


# --- alert state ----------------------------------------------------------------------------------


def load_states(session: Session) -> dict[str, dict[str, ActiveAlert]]:
    """rule -> fingerprint -> ActiveAlert, as the last lease holder left them."""
    out: dict[str, dict[str, ActiveAlert]] = {}
    for row in session.execute(select(AlertState)).scalars():
        out.setdefault(row.rule, {})[row.fingerprint] = ActiveAlert(
            rule=row.rule,
            fingerprint=row.fingerprint,
            labels=dict(row.labels),
            annotations=dict(row.annotations),
            state=row.state,
            active_at=row.active_at,
            value=row.last_value,
            fired_at=row.fired_at,
            resolved_at=row.resolved_at,
            keep_firing_since=row.keep_firing_since,
            last_eval_at=row.last_eval_at,
        )
    return out


def save_rule_states(session: Session, rule: str, alerts: dict[str, ActiveAlert], generator_url: str) -> None:
    """Replace the stored active set of one rule with `alerts` (small: one row per active alert)."""
    existing = {
        row.fingerprint: row for row in session.execute(select(AlertState).where(AlertState.rule == rule)).scalars()
    }
    for fp, alert in alerts.items():
        row = existing.pop(fp, None)
        if row is None:
            row = AlertState(rule=rule, fingerprint=fp)
            session.add(row)
        row.labels, row.annotations, row.state = alert.labels, alert.annotations, alert.state
        row.active_at, row.fired_at, row.resolved_at = alert.active_at, alert.fired_at, alert.resolved_at
        row.keep_firing_since, row.last_value = alert.keep_firing_since, alert.value
        row.last_eval_at = alert.last_eval_at
        row.generator_url = generator_url
    if existing:
        session.execute(delete(AlertState).where(AlertState.rule == rule, AlertState.fingerprint.in_(list(existing))))


def delete_rules_except(session: Session, rules: set[str]) -> int:
    """Forget state of rules no longer loaded (a rule removed from the files cannot resolve)."""
    result = session.execute(
        delete(AlertState).where(AlertState.rule.not_in(list(rules))) if rules else delete(AlertState)
    )
    return rowcount(result) or 0


@dataclass(frozen=True)
class StoredAlert:
    """A pending or firing alert as the last evaluation stored it (for the API and the dashboard)."""

    rule: str
    fingerprint: str
    state: str
    labels: dict[str, str]
    annotations: dict[str, str]
    active_at: float
    fired_at: float | None
    last_eval_at: float
    value: float
    generator_url: str


def current_alerts(session: Session, *, include_pending: bool = True) -> list[StoredAlert]:
    """Firing (and pending) alerts, by rule then fingerprint; resolved ones kept for notification are left out."""
    wanted = [FIRING, PENDING] if include_pending else [FIRING]
    rows = session.execute(
        select(AlertState).where(AlertState.state.in_(wanted)).order_by(AlertState.rule, AlertState.fingerprint)
    ).scalars()
    return [
        StoredAlert(
            rule=r.rule,
            fingerprint=r.fingerprint,
            state=r.state,
            labels=dict(r.labels),
            annotations=dict(r.annotations),
            active_at=r.active_at,
            fired_at=r.fired_at,
            last_eval_at=r.last_eval_at,
            value=r.last_value,
            generator_url=r.generator_url,
        )
        for r in rows
    ]


def notification_bodies(session: Session, ids: list[int]) -> dict[int, str]:
    """Notification id -> the JSON body it sent (the dashboard reads alert history out of it)."""
    if not ids:
        return {}
    stmt = select(AlertNotification.id, AlertNotification.body).where(AlertNotification.id.in_(ids))
    return {int(i): body for i, body in session.execute(stmt)}
