"""The evaluator loop: lease -> evaluate due groups -> match silences -> persist state + outbox (one fenced
txn) -> deliver.

Only the writes are in the transaction: rules are evaluated and silences matched before it opens (with
reads of their own), so neither holds the lease row (PostgreSQL) or SQLite's write lock, which the
collector's ingest on the same database waits for. The transaction's fence still refuses the writes if
the lease changed hands meanwhile.

Programmatic entry (what `kvpilot alerts run` and `kvpilot demo` use):

    handle = start_evaluator("sqlite:///kvpilot-data/kvpilot.db", rule_files=[DEMO_RULES],
                             webhook_urls=["http://127.0.0.1:9095/"], group_wait_s=0)
    ...
    handle.stop()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from alerts.alertmanager import generator_url, labelset_string
from alerts.config import NotifierConfig, webhook_config
from alerts.delivery import DeliveryWorker
from alerts.dispatch import Dispatcher, NotifyAlert, notifiable
from alerts.expr_eval import CachingSource, EvalError, Evaluator, SeriesSource
from alerts.metrics import AlertMetrics
from alerts.rules import BUILTIN_RULES, RuleGroup, load_rule_files
from alerts.silences import silenced_fingerprints
from alerts.state import RuleState
from alerts.store import (
    Lease,
    LeaseLostError,
    delete_rules_except,
    ensure_lease_row,
    load_states,
    release,
    renew,
    save_rule_states,
    try_acquire,
)
from collector.db import make_engine, session_factory, translate_errors
from collector.errors import StorageError

if TYPE_CHECKING:
    from plumbing.serving import ThreadServer

log = logging.getLogger(__name__)

RENEW_AFTER = 1 / 3  # of the lease's TTL: the leader renews once this much has passed, two thirds left for retries


@dataclass
class TickResult:
    leader: bool
    evaluated_rules: int = 0
    series: int = 0
    notifications: list[int] = field(default_factory=list)
    delivered: int = 0
    error: str | None = None


class AlertEvaluator:
    def __init__(
        self,
        factory: sessionmaker[Session],
        groups: list[RuleGroup],
        source: SeriesSource,
        notifier: NotifierConfig,
        *,
        clock: Callable[[], float] = time.time,
        holder: str | None = None,
        lease_ttl_s: float = 15.0,
        metrics: AlertMetrics | None = None,
        deliver: bool = True,
        external_labels: dict[str, str] | None = None,
        delivery: DeliveryWorker | None = None,
    ) -> None:
        self.factory = factory
        self.groups = groups
        self.source = source
        self.notifier = notifier
        self.dispatcher = Dispatcher(notifier)
        self.clock = clock
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.lease_ttl_s = lease_ttl_s
        self.metrics = metrics or AlertMetrics()
        self.external_labels = external_labels or {}
        self.states: dict[str, RuleState] = {r.name + "\0" + g.name: RuleState(r) for g in groups for r in g.rules}
        self.next_eval: dict[str, float] = {}
        self.lease: Lease | None = None
        self._loaded_token: int | None = None
        self.delivery = delivery or (
            DeliveryWorker(
                factory,
                {r.name: r for r in notifier.receivers},
                clock=clock,
                metrics=self.metrics,
                lease_ttl_s=lease_ttl_s,
            )
            if deliver
            else None
        )
        ensure_lease_row(factory)

    def _key(self, state: RuleState) -> str:
        return state.rule.name + "\0" + state.rule.group

    def _reload(self, session: Session) -> None:
        stored = load_states(session)
        for state in self.states.values():
            state.active = {fp: a for fp, a in stored.get(state.rule.name, {}).items()}
        self.next_eval.clear()

    def tick(self) -> TickResult:
        now = self.clock()
        try:
            lease = self._lease(now)
        except StorageError as exc:
            self.metrics.storage_errors.inc()
            log.error("alerts: lease check failed: %s", exc)
            return TickResult(leader=False, error=str(exc))
        if lease is None:
            if self.lease is not None:
                log.warning("alerts: %s lost the evaluator lease", self.holder)
            self.lease, self._loaded_token = None, None
            self.metrics.lease_held.set(0)
            return TickResult(leader=False)
        if self.lease is None or self.lease.token != lease.token:
            log.info("alerts: %s holds the evaluator lease (token %d)", self.holder, lease.token)
        self.lease = lease
        self.metrics.lease_held.set(1)
        result = TickResult(leader=True)
        try:
            self._evaluate_and_dispatch(lease, now, result)
        except LeaseLostError as exc:
            self.metrics.lease_lost.inc()
            log.warning("alerts: %s", exc)
            self.lease, self._loaded_token = None, None
            return TickResult(leader=False, error=str(exc))
        except StorageError as exc:
            self.metrics.storage_errors.inc()
            self._loaded_token = None  # in-memory state may be ahead of the rolled-back rows
            log.error("alerts: tick failed on the database: %s", exc)
            result.error = str(exc)
            return result
        if self.delivery is not None:
            try:
                result.delivered = sum(1 for r in self.delivery.run_once(self.lease) if r.outcome == "delivered")
            except StorageError as exc:
                self.metrics.storage_errors.inc()
                log.error("alerts: delivery failed on the database: %s", exc)
                result.error = str(exc)
        return result

    def _lease(self, now: float) -> Lease | None:
        """The lease this tick runs under: the one held, until a third of its TTL has passed since it was last
        renewed (each tick's fenced write renews it; nobody can take a lease before it expires); then renewed, or
        acquired when free. A renewal of its own every tick cost the leader a committed transaction per poll,
        four a second on a 250-ms group, for a lease of seconds."""
        held = self.lease
        if held is not None and now < held.expires_at - self.lease_ttl_s * (1 - RENEW_AFTER):
            return held
        return try_acquire(self.factory, holder=self.holder, now=now, ttl_s=self.lease_ttl_s)

    def _evaluate_and_dispatch(self, lease: Lease, now: float, result: TickResult) -> None:
        reloaded = self._loaded_token != lease.token
        try:
            with translate_errors():
                if reloaded:
                    with self.factory() as session:
                        self._reload(session)
                changed = self._evaluate(now, result)
                alerts = [
                    NotifyAlert(a, generator_url(self.notifier.external_url, s.rule.expr_text))
                    for s in self.states.values()
                    for a in s.active.values()
                    if notifiable(a)
                ]
                with self.factory() as session:
                    silenced = silenced_fingerprints(
                        session, ((a.alert.fingerprint, a.alert.labels) for a in alerts), now
                    )
                with self.factory() as session:
                    # the fence, extending the lease: a leader that writes every tick needs no renewal of its own
                    renewed = renew(session, lease, now, self.lease_ttl_s)
                    if reloaded:
                        delete_rules_except(session, {s.rule.name for s in self.states.values()})
                    for state in changed:
                        save_rule_states(
                            session,
                            state.rule.name,
                            state.active,
                            generator_url(self.notifier.external_url, state.rule.expr_text),
                        )
                    result.notifications = self.dispatcher.dispatch(
                        session, alerts, now=now, lease=lease, silenced=silenced
                    )
                    session.commit()
        except BaseException:
            self._loaded_token = None  # in-memory state may be ahead of what is stored: reload it next tick
            raise
        self.lease = renewed
        self._loaded_token = lease.token
        for receiver_id in result.notifications:
            log.debug("alerts: enqueued notification %d", receiver_id)
        if result.notifications:
            self.metrics.enqueued.labels("all").inc(len(result.notifications))

    def _evaluate(self, now: float, result: TickResult) -> list[RuleState]:
        """Evaluate the due groups into the in-memory rule states; returns the states evaluated."""
        evaluator = Evaluator(CachingSource(self.source))
        changed: list[RuleState] = []
        for group in [g for g in self.groups if self.next_eval.get(g.name, -1.0) <= now]:
            previous = self.next_eval.get(group.name)
            if previous is None or previous + group.interval_s <= now:
                if previous is not None:  # a whole interval passed since it was due: those evaluations never ran
                    self.metrics.iterations_missed.labels(group.name).inc(int((now - previous) // group.interval_s))
                self.next_eval[group.name] = now + group.interval_s
            else:
                self.next_eval[group.name] = previous + group.interval_s
            started = time.perf_counter()
            self._evaluate_group(group, evaluator, now, result, changed)
            self.metrics.group_duration.labels(group.name).observe(time.perf_counter() - started)
        return changed

    def _evaluate_group(
        self, group: RuleGroup, evaluator: Evaluator, now: float, result: TickResult, changed: list[RuleState]
    ) -> None:
        for rule in group.rules:
            state = self.states[rule.name + "\0" + group.name]
            self.metrics.evaluations.labels(rule.name).inc()
            try:
                vector = evaluator.evaluate(rule.expr, now)
                assert isinstance(vector, dict)
                transitions = state.evaluate(
                    now, vector, external_labels=self.external_labels, external_url=self.notifier.external_url
                )
            except (EvalError, ValueError) as exc:
                self.metrics.evaluation_failures.labels(rule.name).inc()
                log.error("alerts: rule %s (%s) failed: %s", rule.name, rule.source, exc)
                continue
            result.evaluated_rules += 1
            result.series += len(vector)
            self.metrics.series_evaluated.inc(len(vector))
            for t in transitions:
                self.metrics.transitions.labels(t.new_state if not t.dropped else "dropped").inc()
                log.info(
                    "alert %s %s: %s -> %s",
                    rule.name,
                    labelset_string(t.alert.labels),
                    t.old_state,
                    "dropped" if t.dropped else t.new_state,
                )
            changed.append(state)

    def wait_s(self, poll_s: float) -> float:
        """How long the loop may sleep before its next tick: `poll_s` (the lease's renewal, a delivery's retry),
        or less while this evaluator holds the lease and a group falls due sooner, so that a group runs on its
        interval and not at the first poll after it (the poll's sleep starts when a tick ends: a 250-ms group
        behind it ran every 250 ms plus a tick's own time). A group not yet scheduled waits for the poll: a tick
        that failed on the database is not retried at once. An evaluator that cannot keep up ticks again at once
        and counts the evaluations it skipped (`kvpilot_alerts_rule_group_iterations_missed_total`)."""
        if self.lease is None:
            return poll_s
        now = self.clock()
        due = min((self.next_eval.get(g.name, now + poll_s) for g in self.groups), default=now + poll_s)
        return min(poll_s, max(0.0, due - now))

    def step_down(self) -> None:
        if self.lease is not None:
            try:
                release(self.factory, self.lease)
            except StorageError as exc:
                log.warning("alerts: could not release the lease: %s", exc)
        self.lease = None


class EvaluatorHandle:
    """A background thread running `AlertEvaluator.tick` every `poll_s`, or sooner when a group falls due
    (`AlertEvaluator.wait_s`); `stop()` joins it and steps down."""

    def __init__(
        self, evaluator: AlertEvaluator, engine: Engine | None, poll_s: float, api: ThreadServer | None = None
    ) -> None:
        self.evaluator = evaluator
        self.engine = engine
        self.poll_s = poll_s
        self.api = api  # the Alertmanager-compatible API, when start_evaluator was given api_port
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvpilot-alerts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.evaluator.tick()
            except Exception:
                log.exception("alerts: evaluator tick crashed")
            self._stop.wait(self.evaluator.wait_s(self.poll_s))

    @property
    def api_url(self) -> str | None:
        return self.api.url if self.api is not None else None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)
        if self.api is not None:
            self.api.stop()
        self.evaluator.step_down()
        if self.evaluator.delivery is not None:
            self.evaluator.delivery.close()
        if self.engine is not None:
            self.engine.dispose()


def start_evaluator(
    db_url: str,
    *,
    rule_files: list[str | Path] | None = None,
    webhook_urls: list[str] | None = None,
    alertmanager_urls: list[str] | None = None,
    notifier: NotifierConfig | None = None,
    source: SeriesSource | None = None,
    poll_s: float = 0.25,
    group_wait_s: float = 30.0,
    group_interval_s: float = 300.0,
    repeat_interval_s: float = 4 * 3600.0,
    secret: str | None = None,
    metrics: AlertMetrics | None = None,
    api_port: int | None = None,
    api_host: str = "127.0.0.1",
    api_token: str | None = None,
    lease_ttl_s: float = 15.0,
) -> EvaluatorHandle:
    """Start evaluating `rule_files` (default: the built-in rules) against the database at `db_url`.

    `api_port` (0: any free port, see `handle.api_url`): also serve the Alertmanager-compatible API
    (alerts.api) with this evaluator's metrics, on `api_host` (loopback unless told otherwise; any other
    address needs `api_token` or KVPILOT_ALERTS_API_TOKEN, else UnsafeBindError). `lease_ttl_s`: how long
    the evaluator lease outlives its holder's last renewal.
    """
    from alerts.api import create_api_app
    from alerts.api_server import check_api_bind, serve_api
    from alerts.settings import AlertsSettings
    from alerts.sql_source import SqlSource

    if api_port is not None:
        api_token = api_token or AlertsSettings().api_token
        check_api_bind(api_host, api_token)  # before anything starts

    groups = load_rule_files(list(rule_files or [BUILTIN_RULES]))
    engine = make_engine(db_url)
    config = notifier or webhook_config(
        webhook_urls or [],
        secret=secret,
        group_wait_s=group_wait_s,
        group_interval_s=group_interval_s,
        repeat_interval_s=repeat_interval_s,
        alertmanager_urls=alertmanager_urls,
    )
    evaluator = AlertEvaluator(
        session_factory(engine), groups, source or SqlSource(engine), config, metrics=metrics, lease_ttl_s=lease_ttl_s
    )
    api = None
    if api_port is not None:
        app = create_api_app(engine=engine, metrics=evaluator.metrics, token=api_token, notifier=config)
        try:
            api = serve_api(app, host=api_host, port=api_port)
        except RuntimeError:
            if evaluator.delivery is not None:
                evaluator.delivery.close()
            engine.dispose()
            raise
    return EvaluatorHandle(evaluator, engine, poll_s, api)
