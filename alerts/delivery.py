"""The outbox worker: deliver notifications with retries, exponential backoff with full jitter, HMAC.

2xx: delivered. 5xx, 408, 429 and network errors: retried after uniform(0, min(cap, base * 2**attempts))
seconds (AWS's "full jitter"), until `max_age_s` after creation (then `expired`). Any other 4xx: `failed`
at once (the receiver will not accept it on a retry). Every attempt is a row in alert_notification_attempts.
Per (receiver, group) only the oldest unfinished notification is sent, so a receiver that was down sees
firing before resolved, each exactly once (`Idempotency-Key` lets it drop a retry whose 2xx it sent but we
never read). Claims are fenced by the lease: a superseded evaluator can neither claim nor record.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.config import Receiver
from alerts.metrics import AlertMetrics
from alerts.store import Lease, LeaseLostError, fence
from collector.db import translate_errors
from collector.schema import AlertNotification, AlertNotificationAttempt

log = logging.getLogger(__name__)
SIGNATURE_HEADER = "X-Kvpilot-Signature"
USER_AGENT = "kvpilot-alerts/0.1 (Alertmanager webhook v4)"
RETRYABLE_4XX = frozenset({408, 429})


def sign(body: bytes, secret: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def backoff_s(attempts: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    return rng.uniform(0.0, min(cap_s, base_s * (2 ** max(attempts - 1, 0))))


@dataclass
class DeliveryResult:
    notification_id: int
    outcome: str  # delivered retry failed expired
    http_status: int | None
    error: str | None


class DeliveryWorker:
    def __init__(
        self,
        factory: sessionmaker[Session],
        receivers: dict[str, Receiver],
        *,
        clock: Callable[[], float] = time.time,
        metrics: AlertMetrics | None = None,
        client: httpx.Client | None = None,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        max_age_s: float = 24 * 3600.0,
        batch: int = 50,
        rng: random.Random | None = None,
    ) -> None:
        self.factory = factory
        self.receivers = receivers
        self.clock = clock
        self.metrics = metrics or AlertMetrics()
        self.client = client or httpx.Client(follow_redirects=False)
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_age_s = max_age_s
        self.batch = batch
        self.rng = rng or random.Random()

    def close(self) -> None:
        self.client.close()

    def run_once(self, lease: Lease) -> list[DeliveryResult]:
        """Claim the due head-of-line notifications, POST them, record the outcomes."""
        claimed = self._claim(lease)
        results = []
        for row in claimed:
            results.append(self._deliver(row, lease))
        return results

    def _claim(self, lease: Lease) -> list[AlertNotification]:
        now = self.clock()
        with translate_errors(), self.factory() as session:
            try:
                fence(session, lease, now)
            except LeaseLostError:
                session.rollback()
                self.metrics.lease_lost.inc()
                return []
            pending = (
                session.execute(
                    select(AlertNotification)
                    .where(AlertNotification.status == "pending")
                    .order_by(AlertNotification.id)
                )
                .scalars()
                .all()
            )
            heads: dict[tuple[str, str], AlertNotification] = {}
            for row in pending:
                heads.setdefault((row.receiver, row.group_key), row)
            due = [
                r
                for r in heads.values()
                if r.next_attempt_at <= now and (r.claim_expires_at is None or r.claim_expires_at < now)
            ][: self.batch]
            for row in due:
                receiver = self.receivers.get(row.receiver)
                timeout = receiver.timeout_s if receiver else 10.0
                row.claim_token, row.claim_expires_at = lease.token, now + timeout + 5.0
            session.commit()
            for row in due:
                session.expunge(row)
            return list(due)

    def _deliver(self, row: AlertNotification, lease: Lease) -> DeliveryResult:
        receiver = self.receivers.get(row.receiver)
        started = self.clock()
        wall_started = time.monotonic()
        status: int | None = None
        error: str | None = None
        if receiver is None:
            outcome, error = "failed", f"receiver {row.receiver!r} is no longer configured"
        else:
            body = row.body.encode()
            headers = {
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
                "Idempotency-Key": row.idempotency_key,
            }
            if receiver.secret:
                headers[SIGNATURE_HEADER] = sign(body, receiver.secret)
            try:
                response = self.client.post(row.url, content=body, headers=headers, timeout=receiver.timeout_s)
                status = response.status_code
                if 200 <= status < 300:
                    outcome = "delivered"
                elif status >= 500 or status in RETRYABLE_4XX:
                    outcome, error = "retry", f"HTTP {status}: {response.text[:200]}"
                else:
                    outcome, error = "failed", f"HTTP {status}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                outcome, error = "retry", f"{type(exc).__name__}: {exc}"
        duration = time.monotonic() - wall_started
        now = self.clock()
        if outcome == "retry" and now - row.created_at >= self.max_age_s:
            outcome = "expired"
        self._record(row, lease, outcome, status, error, started, duration, now)
        return DeliveryResult(row.id, outcome, status, error)

    def _record(
        self,
        row: AlertNotification,
        lease: Lease,
        outcome: str,
        status: int | None,
        error: str | None,
        started: float,
        duration: float,
        now: float,
    ) -> None:
        self.metrics.attempts.labels(row.receiver, outcome).inc()
        if outcome == "delivered":
            log.info(
                "notification %s delivered to %s (attempt %d)", row.idempotency_key, row.receiver, row.attempts + 1
            )
        else:
            log.warning("notification %s to %s: %s (%s)", row.idempotency_key, row.receiver, outcome, error)
        with translate_errors(), self.factory() as session:
            try:
                fence(session, lease, now)
            except LeaseLostError:
                session.rollback()
                self.metrics.lease_lost.inc()
                log.warning(
                    "lease lost before recording delivery of %s; the next holder retries it "
                    "(the receiver can dedup on Idempotency-Key)",
                    row.idempotency_key,
                )
                return
            current = session.get(AlertNotification, row.id)
            if current is None or current.status != "pending":
                session.rollback()
                return
            current.attempts += 1
            current.claim_token = current.claim_expires_at = None
            current.last_error = error
            if outcome == "delivered":
                current.status, current.delivered_at = "delivered", now
                self.metrics.delivery_latency.observe(max(0.0, now - current.due_at))
            elif outcome == "retry":
                current.next_attempt_at = now + backoff_s(
                    current.attempts, base_s=self.base_backoff_s, cap_s=self.max_backoff_s, rng=self.rng
                )
            else:
                current.status = outcome
            if outcome != "retry":
                self.metrics.finished.labels(row.receiver, current.status).inc()
            session.add(
                AlertNotificationAttempt(
                    notification_id=row.id,
                    attempt=current.attempts,
                    started_at=started,
                    duration_s=duration,
                    http_status=status,
                    outcome=outcome,
                    error=error,
                )
            )
            session.commit()


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
