"""The outbox worker: deliver notifications with retries, exponential backoff with full jitter, HMAC.

2xx: delivered. 5xx, 408, 429 and network errors: retried after uniform(0, min(cap, base * 2**attempts))
seconds (AWS's "full jitter"), until `max_age_s` after creation (then `expired`). Any other 4xx: `failed`
at once (the receiver will not accept it on a retry). Every attempt is a row in alert_notification_attempts.
A 2xx also ends the receiver's backoff: its other waiting notifications are due at once, so a backlog
clears in a tick or two after the receiver recovers. Per (receiver, group) one notification is in flight,
oldest first, a stale backlog collapsed to the newest (alerts.outbox); `Idempotency-Key` lets the receiver
drop a retry whose 2xx it sent but we never read.

The lease bounds every POST, not only the writes: claims are fenced, and right before each POST the worker
renews the lease (fenced by its token) and re-checks that the row is still its claim, then posts with a
deadline that ends `guard` before the renewed lease does, so the POST and its record are done before
another evaluator can take the lease. A worker that lost the lease stops its batch without posting.
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
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from alerts.config import Receiver
from alerts.metrics import AlertMetrics
from alerts.outbox import claim_due, pending
from alerts.outbox import list_notifications as list_notifications
from alerts.store import Lease, LeaseLostError, fence, renew
from collector.db import rowcount, translate_errors
from collector.schema import AlertNotification, AlertNotificationAttempt

log = logging.getLogger(__name__)
SIGNATURE_HEADER = "X-Kvpilot-Signature"
USER_AGENT = "kvpilot-alerts/0.1 (Alertmanager webhook v4)"
RETRYABLE_4XX = frozenset({408, 429})
MAX_RESPONSE_BYTES = 4096  # what is kept of a receiver's answer (for last_error); the rest is not read


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
        lease_ttl_s: float = 15.0,
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
        self.lease_ttl_s = lease_ttl_s
        # what a POST leaves of the renewed lease, for recording its outcome (and for clock jitter)
        self.guard_s = max(0.2 * lease_ttl_s, 0.25)

    def close(self) -> None:
        self.client.close()

    def run_once(self, lease: Lease) -> list[DeliveryResult]:
        """Claim the due head-of-line notifications, POST them (each under a renewed lease), record outcomes."""
        results = []
        for row in self._claim(lease):
            try:
                lease = self._renew(row, lease)
            except LeaseLostError as exc:
                self.metrics.lease_lost.inc()
                log.warning("alerts: not posting %s, batch stopped: %s", row.idempotency_key, exc)
                break
            results.append(self._deliver(row, lease))
        return results

    def _claim(self, lease: Lease) -> list[AlertNotification]:
        now = self.clock()
        with translate_errors(), self.factory() as session:  # a read of its own: the fence opens the write
            if not pending(session):
                return []  # nothing to claim: no fenced write (a committed transaction every tick of a quiet fleet)
        with translate_errors(), self.factory() as session:
            try:
                fence(session, lease, now)
            except LeaseLostError:
                session.rollback()
                self.metrics.lease_lost.inc()
                return []
            due = claim_due(
                session,
                now=now,
                token=lease.token,
                claim_until=lease.expires_at,
                batch=self.batch,
                on_superseded=self._superseded,
            )
            session.commit()
            for row in due:
                session.expunge(row)
            return due

    def _superseded(self, row: AlertNotification) -> None:
        self.metrics.superseded.labels(row.receiver).inc()
        self.metrics.finished.labels(row.receiver, "superseded").inc()
        log.info("notification %s to %s: %s", row.idempotency_key, row.receiver, row.last_error)

    def _renew(self, row: AlertNotification, lease: Lease) -> Lease:
        """Extend the lease and the row's claim right before its POST; LeaseLostError if either is gone."""
        now = self.clock()
        with translate_errors(), self.factory() as session:
            renewed = renew(session, lease, now, self.lease_ttl_s)
            still_ours = session.execute(
                update(AlertNotification)
                .where(
                    AlertNotification.id == row.id,
                    AlertNotification.status == "pending",
                    AlertNotification.claim_token == lease.token,
                )
                .values(claim_expires_at=renewed.expires_at)
            )
            if rowcount(still_ours) != 1:
                session.rollback()
                raise LeaseLostError(f"notification {row.idempotency_key} is no longer claimed by {lease.holder}")
            session.commit()
        return renewed

    def _post(
        self, row: AlertNotification, receiver: Receiver, deadline_s: float
    ) -> tuple[str, int | None, str | None]:
        """One POST that ends within `deadline_s` seconds (each phase's timeout is what is left of it)."""
        body = row.body.encode()
        headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, "Idempotency-Key": row.idempotency_key}
        if receiver.secret:
            headers[SIGNATURE_HEADER] = sign(body, receiver.secret)
        deadline = time.monotonic() + deadline_s
        try:
            with self.client.stream("POST", row.url, content=body, headers=headers, timeout=deadline_s) as response:
                answer = b""
                for chunk in response.iter_bytes():
                    answer += chunk
                    if len(answer) >= MAX_RESPONSE_BYTES or time.monotonic() > deadline:
                        break
            status = response.status_code
        except httpx.HTTPError as exc:
            return "retry", None, f"{type(exc).__name__}: {exc}"
        text = answer[:200].decode(errors="replace")
        if 200 <= status < 300:
            return "delivered", status, None
        if status >= 500 or status in RETRYABLE_4XX:
            return "retry", status, f"HTTP {status}: {text}"
        return "failed", status, f"HTTP {status}: {text}"

    def _deliver(self, row: AlertNotification, lease: Lease) -> DeliveryResult:
        receiver = self.receivers.get(row.receiver)
        started = self.clock()
        wall_started = time.monotonic()
        status: int | None = None
        error: str | None = None
        if receiver is None:
            outcome, error = "failed", f"receiver {row.receiver!r} is no longer configured"
        else:
            budget = min(receiver.timeout_s, lease.expires_at - started - self.guard_s)
            outcome, status, error = self._post(row, receiver, max(budget, 0.05))
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
                self._end_backoff(session, row.receiver, now)
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

    @staticmethod
    def _end_backoff(session: Session, receiver: str, now: float) -> None:
        """The receiver answers again: whatever waits for it is due now, not after its own backoff."""
        session.execute(
            update(AlertNotification)
            .where(
                AlertNotification.receiver == receiver,
                AlertNotification.status == "pending",
                AlertNotification.next_attempt_at > now,
            )
            .values(next_attempt_at=now)
        )
