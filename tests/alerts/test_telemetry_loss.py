"""TelemetryLoss fires on stored gap records (through SqlSource, the rules' read path)."""

from __future__ import annotations

import json

from alerts.metrics import AlertMetrics
from alerts.rules import BUILTIN_RULES, load_rule_files
from alerts.runner import AlertEvaluator
from alerts.sql_source import SqlSource
from collector.db import session_factory
from collector.ingest import parse_batch, store_batch
from tests.alerts.conftest import FakeClock
from tests.collector import evfactory

T = 1_760_000_040.0


def test_telemetry_loss_fires_on_a_stored_gap_record_and_resolves(db_engine, config_for, sink):
    # Samples every 15 s, then a 3-minute hole (nothing stored) and the gap record the sink sent after it.
    events = [dict(evfactory.sample(0), ts=T + 15.0 * k) for k in range(8)]
    events.append(evfactory.gap(0, ts=T + 300.0, events=3176, first_ts=T + 120.0, last_ts=T + 299.0))
    body = json.dumps({"events": events}).encode()
    store_batch(db_engine, parse_batch(body, max_events=100), idempotency_key=None, content=body)
    clock = FakeClock(T)
    ev = AlertEvaluator(
        session_factory(db_engine),
        load_rule_files([BUILTIN_RULES]),
        SqlSource(db_engine, clock=clock),
        config_for(sink),
        clock=clock,
        metrics=AlertMetrics(),
    )
    seen = {}
    try:
        for t in (T + 285.0, T + 300.0, T + 315.0, T + 600.0, T + 900.0):
            clock.now = t
            assert ev.tick().error is None
            state = next(s for s in ev.states.values() if s.rule.name == "TelemetryLoss")
            seen[t - T] = [(a.state, dict(a.labels), a.value) for a in state.active.values()]
    finally:
        if ev.delivery is not None:
            ev.delivery.close()
    assert seen[285.0] == []
    labels = {
        "alertname": "TelemetryLoss",
        "instance": "e0",
        "kind": "request",
        "reason": "spool_full",
        "severity": "warning",
    }
    # increase() extrapolates to the range's edges as Prometheus does: at least the 3176 the record holds.
    for t in (300.0, 315.0):
        ((state_name, alert_labels, value),) = seen[t]
        assert (state_name, alert_labels) == ("firing", labels) and 3176 <= value < 3176 * 1.1
    assert seen[600.0][0][0] == "firing"  # keep_firing_for: 5m past the last increase
    assert [s for s, _, _ in seen[900.0]] in ([], ["inactive"])
