"""Alertmanager's dispatcher inside the evaluator transaction: grouping, silences, dedup, the outbox.

Per route and group (group_by labels), as Alertmanager's aggregation groups and notification log do:
the first flush waits group_wait, later flushes come every group_interval; a flush notifies when a
firing alert is new since the last notification, when all alerts resolved, when (send_resolved) an
alert resolved, or when repeat_interval passed. Resolved alerts leave the group after one flush.
Silenced alerts are not notified; the evaluator matches silences before its transaction opens and passes
the muted fingerprints in (`silenced`). Notifications are rows in the outbox, written in the same
transaction as the state change that caused them (and fenced by the lease), so none is lost or written twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from alerts.alertmanager import group_key, postable_alert, webhook_alert, webhook_body, webhook_payload
from alerts.config import NotifierConfig, Receiver, ResolvedRoute, resolve_routes, routes_for
from alerts.silences import silenced_fingerprints
from alerts.state import FIRING, INACTIVE, ActiveAlert
from alerts.store import Lease
from collector.schema import AlertGroup, AlertNotification

log = logging.getLogger(__name__)
FORWARD_KEY = "__alertmanager_forward__"


@dataclass(frozen=True)
class NotifyAlert:
    """An alert as the notifier sees it: firing, or resolved and not yet flushed."""

    alert: ActiveAlert
    generator_url: str

    @property
    def status(self) -> str:
        return "firing" if self.alert.state == FIRING else "resolved"


def notifiable(alert: ActiveAlert) -> bool:
    return alert.state == FIRING or (alert.state == INACTIVE and alert.resolved_at is not None)


def _group_labels(labels: dict[str, str], group_by: list[str]) -> dict[str, str]:
    if "..." in group_by:
        return dict(labels)
    return {k: labels[k] for k in group_by if k in labels}


def _needs_update(
    row: AlertGroup, firing: set[str], resolved: set[str], repeat_s: float, send_resolved: bool, now: float
) -> bool:
    if row.last_notified_at is None:
        return bool(firing)
    if not firing <= set(row.last_firing):
        return True
    if not firing:
        return bool(row.last_firing)
    if send_resolved and not resolved <= set(row.last_resolved):
        return True
    return row.last_notified_at < now - repeat_s


class Dispatcher:
    def __init__(self, config: NotifierConfig) -> None:
        self.config = config
        self.root, self.children = resolve_routes(config)
        self.receivers: dict[str, Receiver] = {r.name: r for r in config.receivers}
        self.forwards = [r for r in config.receivers if r.kind == "alertmanager"]

    def dispatch(
        self,
        session: Session,
        alerts: list[NotifyAlert],
        *,
        now: float,
        lease: Lease,
        silenced: Collection[str] | None = None,
    ) -> list[int]:
        """Decide and enqueue notifications; returns the new outbox row ids. `silenced`: the fingerprints
        muted now (None: match the active silences here, in this session)."""
        if silenced is None:
            silenced = silenced_fingerprints(session, ((a.alert.fingerprint, a.alert.labels) for a in alerts), now)
        live = [a for a in alerts if a.alert.fingerprint not in silenced]
        if len(live) != len(alerts):
            log.debug("silences muted %d alert(s)", len(alerts) - len(live))
        groups: dict[tuple[str, str], tuple[ResolvedRoute, dict[str, str], list[NotifyAlert]]] = {}
        for item in live:
            for route in routes_for(item.alert.labels, self.root, self.children):
                receiver = self.receivers.get(route.receiver)
                if receiver is None or receiver.kind != "webhook":
                    continue
                labels = _group_labels(item.alert.labels, route.group_by)
                key = (route.receiver, group_key(route.key, labels))
                groups.setdefault(key, (route, labels, []))[2].append(item)
        rows = {(r.receiver, r.group_key): r for r in session.execute(select(AlertGroup)).scalars()}
        created: list[int] = []
        for (receiver_name, gkey), (route, labels, items) in groups.items():
            row = rows.pop((receiver_name, gkey), None)
            if row is None:
                row = AlertGroup(
                    receiver=receiver_name,
                    group_key=gkey,
                    group_labels=labels,
                    created_at=now,
                    next_flush_at=now + route.group_wait_s,
                    last_notified_at=None,
                    last_firing=[],
                    last_resolved=[],
                    flushed_resolved=[],
                    seq=0,
                )
                session.add(row)
            if now < row.next_flush_at:
                continue
            notification = self._flush(row, route, self.receivers[receiver_name], labels, items, now, lease)
            if notification is not None:
                session.add(notification)
                session.flush()
                created.append(notification.id)
        for (receiver_name, _gkey), row in rows.items():
            if receiver_name in self.receivers and self.receivers[receiver_name].kind == "alertmanager":
                continue
            session.delete(row)  # empty group: Alertmanager drops it after its last flush
        for receiver in self.forwards:
            notification = self._forward(session, receiver, live, now, lease)
            if notification is not None:
                session.add(notification)
                session.flush()
                created.append(notification.id)
        return created

    def _flush(
        self,
        row: AlertGroup,
        route: ResolvedRoute,
        receiver: Receiver,
        labels: dict[str, str],
        items: list[NotifyAlert],
        now: float,
        lease: Lease,
    ) -> AlertNotification | None:
        flushed = {(fp, at) for fp, at in row.flushed_resolved}
        current = [
            i for i in items if i.status == "firing" or (i.alert.fingerprint, i.alert.resolved_at) not in flushed
        ]
        firing = {i.alert.fingerprint for i in current if i.status == "firing"}
        resolved = {i.alert.fingerprint for i in current if i.status == "resolved"}
        row.next_flush_at = now + route.group_interval_s
        resolved_now = [[i.alert.fingerprint, i.alert.resolved_at] for i in current if i.status == "resolved"]
        live_resolved = {(i.alert.fingerprint, i.alert.resolved_at) for i in items if i.status == "resolved"}
        row.flushed_resolved = [list(p) for p in flushed if p in live_resolved] + resolved_now
        if not _needs_update(row, firing, resolved, route.repeat_interval_s, receiver.send_resolved, now):
            return None
        row.seq += 1
        row.last_notified_at = now
        row.last_firing = sorted(firing)
        row.last_resolved = sorted(resolved)
        sent = [i for i in current if i.status == "firing" or receiver.send_resolved]
        if not sent:
            return None
        payload = webhook_payload(
            receiver=receiver.name,
            alerts=[_webhook_alert(i) for i in sent],
            group_labels=labels,
            group_key_text=row.group_key,
            external_url=self.config.external_url,
            max_alerts=receiver.max_alerts,
        )
        digest = hashlib.sha256(row.group_key.encode()).hexdigest()[:16]
        # A group's row goes when the group empties and comes back with seq 0 when it fills again, so the key
        # names the row's incarnation (its creation time, the same for any evaluator reading the row) as well.
        incarnation = round(row.created_at * 1000)
        key = f"{receiver.name}/{digest}/{incarnation}/{row.seq}"
        return _outbox(receiver, key, row.group_key, webhook_body(payload), now, lease)

    def _forward(
        self, session: Session, receiver: Receiver, live: list[NotifyAlert], now: float, lease: Lease
    ) -> AlertNotification | None:
        """Prometheus's own behaviour towards Alertmanager: resend all active alerts on change and every minute."""
        row = session.execute(
            select(AlertGroup).where(AlertGroup.receiver == receiver.name, AlertGroup.group_key == FORWARD_KEY)
        ).scalar_one_or_none()
        if row is None:
            row = AlertGroup(
                receiver=receiver.name,
                group_key=FORWARD_KEY,
                group_labels={},
                created_at=now,
                next_flush_at=now,
                last_notified_at=None,
                last_firing=[],
                last_resolved=[],
                flushed_resolved=[],
                seq=0,
            )
            session.add(row)
        firing = sorted(i.alert.fingerprint for i in live if i.status == "firing")
        resolved = sorted(i.alert.fingerprint for i in live if i.status == "resolved")
        changed = firing != row.last_firing or resolved != row.last_resolved
        due = row.last_notified_at is None or now - row.last_notified_at >= self.config.alertmanager_resend_s
        if not live or not (changed or due):
            if not live:
                row.last_firing, row.last_resolved = [], []
            return None
        valid_until = now + 4 * max(self.config.alertmanager_resend_s, 1.0)
        body = [
            postable_alert(
                labels=i.alert.labels,
                annotations=i.alert.annotations,
                starts_at=i.alert.fired_at or i.alert.active_at,
                ends_at=i.alert.resolved_at
                if i.status == "resolved" and i.alert.resolved_at is not None
                else valid_until,
                generator=i.generator_url,
            )
            for i in live
        ]
        row.seq += 1
        row.last_notified_at, row.last_firing, row.last_resolved = now, firing, resolved
        text = json.dumps(body, separators=(",", ":"))  # Alertmanager parses these; only what it sends is byte-exact
        return _outbox(receiver, f"{receiver.name}/forward/{row.seq}", FORWARD_KEY, text, now, lease)


def _webhook_alert(item: NotifyAlert) -> dict[str, Any]:
    a = item.alert
    return webhook_alert(
        status=item.status,
        labels=a.labels,
        annotations=a.annotations,
        starts_at=a.fired_at or a.active_at,
        ends_at=a.resolved_at,
        generator=item.generator_url,
    )


def _outbox(receiver: Receiver, key: str, gkey: str, body: str, now: float, lease: Lease) -> AlertNotification:
    return AlertNotification(
        idempotency_key=key,
        receiver=receiver.name,
        kind=receiver.kind,
        url=receiver.url,
        group_key=gkey,
        body=body,
        status="pending",
        attempts=0,
        created_at=now,
        next_attempt_at=now,
        claim_token=None,
        claim_expires_at=None,
        delivered_at=None,
        last_error=None,
        fencing_token=lease.token,
        due_at=now,
    )
