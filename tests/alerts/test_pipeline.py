"""End to end on SQLite and PostgreSQL: state machine + lease + outbox + delivery to a real local receiver."""

from __future__ import annotations

import pytest
from sqlalchemy import event, func, select

from alerts.alertmanager import fingerprint
from alerts.memory_source import MemorySource
from alerts.sink import run_webhook_sink
from collector.schema import AlertEvaluatorLease, AlertNotification, AlertNotificationAttempt, AlertState


def _feed(source: MemorySource, clock, value: float, seconds: float, step: float = 10.0, instance: str = "a") -> None:
    """Write `value` for `seconds` of fake time, one point per step, without evaluating."""
    t = 0.0
    while t < seconds:
        source.add("queue_depth", instance, clock.now + t, value)
        t += step


def _run(ev, source, clock, value, seconds, step=10.0, instance="a"):
    results = []
    end = clock.now + seconds
    while clock.now < end:
        source.add("queue_depth", instance, clock.now, value)
        results.append(ev.tick())
        clock.advance(step)
    return results


def test_fires_after_for_and_resolves_with_v4_payload(config_for, make_evaluator, groups, sink, clock):
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    _run(ev, source, clock, 50, 30)
    _run(ev, source, clock, 500, 20)  # pending at t=30, t=40
    assert not sink.received
    assert ev.states["QueueHigh\0test"].active
    assert next(iter(ev.states["QueueHigh\0test"].active.values())).state == "pending"
    _run(ev, source, clock, 500, 40)  # fires when held for 30s
    assert sink.wait_for(1, 5)
    _run(ev, source, clock, 10, 30)  # resolves
    assert sink.wait_for(2, 5)
    firing, resolved = (r.payload for r in sink.received[:2])
    assert [firing["status"], resolved["status"]] == ["firing", "resolved"]
    assert set(firing) == {
        "receiver",
        "status",
        "alerts",
        "groupLabels",
        "commonLabels",
        "commonAnnotations",
        "externalURL",
        "version",
        "groupKey",
        "truncatedAlerts",
    }
    assert firing["version"] == "4" and firing["truncatedAlerts"] == 0
    assert firing["groupKey"] == '{}:{alertname="QueueHigh"}'
    labels = {"alertname": "QueueHigh", "instance": "a", "severity": "page"}
    alert = firing["alerts"][0]
    assert alert["labels"] == labels and alert["fingerprint"] == fingerprint(labels)
    assert alert["annotations"] == {"summary": "a queue 500"}
    assert alert["endsAt"] == "0001-01-01T00:00:00Z" and alert["startsAt"].endswith("Z")
    assert "graph?g0.expr=queue_depth" in alert["generatorURL"]
    assert resolved["alerts"][0]["status"] == "resolved" and resolved["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    assert all(r.signature_ok for r in sink.received)
    assert sink.duplicates == 0


def test_receiver_down_for_minutes_gets_the_group_state_once(config_for, make_evaluator, groups, clock):
    """Fired and resolved while the receiver was down: the stale `firing` is superseded by the `resolved`
    that says the same alert's current state (Alertmanager sends a group's current state after an outage)."""
    outage = run_webhook_sink(port=0, secret="s3cret", log_payloads=False)
    outage.status_code = 503  # up but failing: a real HTTP 5xx
    port = outage.server.server_address[1]
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(outage), base_backoff_s=1.0, max_backoff_s=60.0)
    _run(ev, source, clock, 500, 60)  # fires
    outage.stop()  # now connection refused: network errors
    _run(ev, source, clock, 10, 30)  # resolves while down
    _run(ev, source, clock, 10, 300, step=15)  # five more minutes down
    with ev.factory() as s:
        rows = s.execute(select(AlertNotification).order_by(AlertNotification.id)).scalars().all()
        assert [r.status for r in rows] == ["expired", "pending"]
        assert rows[0].attempts >= 3 and rows[0].last_error.startswith("superseded by notification")
        assert rows[1].attempts >= 1  # the resolved one is the group's head now, retried
    back = run_webhook_sink(port=port, secret="s3cret", log_payloads=False)
    try:
        for _ in range(30):
            ev.tick()
            clock.advance(60)
            if back.received:
                break
        assert back.wait_for(1, 5)
        for _ in range(5):
            ev.tick()
            clock.advance(60)
        assert [r.payload["status"] for r in back.received] == ["resolved"]
        assert back.duplicates == 0
        with ev.factory() as s:
            statuses = s.execute(select(AlertNotification.status).order_by(AlertNotification.id)).scalars().all()
            assert statuses == ["expired", "delivered"]
            outcomes = s.execute(select(AlertNotificationAttempt.outcome)).scalars().all()
            assert outcomes.count("delivered") == 1 and outcomes.count("retry") >= 3
        assert ev.metrics.superseded.labels("webhook")._value.get() == 1
    finally:
        back.stop()


def test_4xx_is_failed_not_retried(config_for, make_evaluator, groups, clock):
    bad = run_webhook_sink(port=0, log_payloads=False)
    bad.status_code = 422
    try:
        source = MemorySource()
        ev = make_evaluator(source, groups, config_for(bad))
        _run(ev, source, clock, 500, 120)
        with ev.factory() as s:
            row = s.execute(select(AlertNotification)).scalar_one()
            assert row.status == "failed" and row.attempts == 1 and "HTTP 422" in row.last_error
        assert ev.metrics.finished.labels("webhook", "failed")._value.get() == 1
    finally:
        bad.stop()


def test_restart_mid_pending_keeps_active_at(config_for, make_evaluator, groups, sink, clock):
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    _run(ev, source, clock, 500, 20)  # pending since t0
    ev.step_down()
    ev2 = make_evaluator(source, groups, config_for(sink), holder="b")
    _run(ev2, source, clock, 500, 10)
    assert not sink.received  # 20s held: still pending
    _run(ev2, source, clock, 500, 20)  # 30s after the *original* active_at
    assert sink.wait_for(1, 5)
    assert len(sink.received) == 1


def test_restart_mid_firing_does_not_repage(config_for, make_evaluator, groups, sink, clock):
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    _run(ev, source, clock, 500, 60)
    assert sink.wait_for(1, 5)
    ev.step_down()
    ev2 = make_evaluator(source, groups, config_for(sink), holder="b")
    _run(ev2, source, clock, 500, 120)
    assert len(sink.received) == 1  # no re-page within repeat_interval
    _run(ev2, source, clock, 10, 30)
    assert sink.wait_for(2, 5)
    assert [r.payload["status"] for r in sink.received] == ["firing", "resolved"]


def test_two_evaluators_page_once(config_for, make_evaluator, groups, sink, clock):
    source = MemorySource()
    a = make_evaluator(source, groups, config_for(sink), holder="a")
    b = make_evaluator(source, groups, config_for(sink), holder="b")
    leaders = []
    for _ in range(12):
        source.add("queue_depth", "a", clock.now, 500)
        leaders.append((a.tick().leader, b.tick().leader))
        clock.advance(10)
    assert all(x != y for x, y in leaders)
    assert sink.wait_for(1, 5)
    assert len(sink.received) == 1
    with a.factory() as s:
        assert s.execute(select(func.count()).select_from(AlertNotification)).scalar_one() == 1


def test_superseded_evaluator_cannot_write(config_for, make_evaluator, groups, sink, clock):
    source = MemorySource()
    a = make_evaluator(source, groups, config_for(sink), holder="a", lease_ttl_s=15)
    _run(a, source, clock, 500, 20)
    old_lease = a.lease
    clock.advance(30)  # a is "paused" past its lease
    b = make_evaluator(source, groups, config_for(sink), holder="b", lease_ttl_s=15)
    assert b.tick().leader
    from alerts.store import LeaseLostError, fence

    with a.factory() as s:
        try:
            fence(s, old_lease, clock.now)
        except LeaseLostError:
            pass
        else:
            raise AssertionError("a stale lease must be refused")
    assert a.tick().leader is False
    assert a.metrics.lease_held._value.get() == 0


def test_the_leaders_fenced_write_renews_its_lease_and_a_standby_writes_nothing(
    config_for, make_evaluator, groups, sink, clock
):
    source = MemorySource()
    a = make_evaluator(source, groups, config_for(sink), holder="a", lease_ttl_s=15)
    b = make_evaluator(source, groups, config_for(sink), holder="b", lease_ttl_s=15)
    statements: dict[str, list[str]] = {"a": [], "b": []}
    for name, ev in (("a", a), ("b", b)):
        event.listen(
            ev.factory.kw["bind"], "before_cursor_execute", lambda *args, n=name: statements[n].append(args[2])
        )

    def lease_writes(name: str) -> int:
        writes = [
            sql for sql in statements.pop(name) if sql.lstrip().upper().startswith("UPDATE ALERT_EVALUATOR_LEASE")
        ]
        statements[name] = []
        return len(writes)

    def expires_at() -> float:
        with a.factory() as s:
            return s.execute(select(AlertEvaluatorLease.expires_at)).scalar_one()

    assert a.tick().leader and b.tick().leader is False
    lease_writes("a"), lease_writes("b")
    for _ in range(3):  # ticks within a third of the TTL: the tick's own fenced write renews, nothing else does
        clock.advance(4.9)
        assert a.tick().leader and expires_at() == pytest.approx(clock.now + 15, abs=1e-3)
        assert lease_writes("a") == 1  # no renewal of its own, no fenced claim with nothing pending
        assert b.tick().leader is False and lease_writes("b") == 0
    clock.advance(5.1)  # a third of the TTL since the last write: renewed before the tick, then fenced again
    assert a.tick().leader and lease_writes("a") == 2
    clock.advance(15.1)  # a stopped: its lease expired, b takes it, and a's next tick finds it gone
    assert b.tick().leader and a.tick().leader is False


def test_silence_mutes_notification(config_for, make_evaluator, groups, sink, clock):
    from alerts.silences import SilenceIn, create_silence, parse_matcher

    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    with ev.factory() as s:
        create_silence(
            s,
            SilenceIn(
                matchers=[parse_matcher("instance=a")], startsAt=clock.now, endsAt=clock.now + 3600, createdBy="test"
            ),
            now=clock.now,
        )
        s.commit()
    _run(ev, source, clock, 500, 60, instance="a")
    _run(ev, source, clock, 500, 60, instance="b")
    assert sink.wait_for(1, 5)
    instances = [a["labels"]["instance"] for r in sink.received for a in r.payload["alerts"]]
    assert "a" not in instances and "b" in instances
    with ev.factory() as s:
        assert {r.labels["instance"] for r in s.execute(select(AlertState)).scalars()} == {"a", "b"}


def test_an_alert_that_fires_again_after_resolving_pages_again(config_for, make_evaluator, groups, sink, clock):
    """Firing, resolved, then a new pending alert replaces the resolved one: the group empties and its row goes.
    The group's next notification must not reuse the first one's outbox key (that failed every tick after it)."""
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    _run(ev, source, clock, 500, 60)  # fires
    _run(ev, source, clock, 10, 30)  # resolves
    assert sink.wait_for(2, 5)
    results = _run(ev, source, clock, 500, 60)  # pending again (the group has nothing to send), then fires again
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    assert sink.wait_for(3, 5)
    assert [r.payload["status"] for r in sink.received] == ["firing", "resolved", "firing"]
    assert sink.duplicates == 0
    with ev.factory() as s:
        keys = s.execute(select(AlertNotification.idempotency_key)).scalars().all()
        assert len(keys) == len(set(keys)) == 3


GPU_RULES = """
groups:
  - name: gpus
    interval: 10s
    rules:
      - alert: MemoryPressure
        expr: memory_usage > 0.9
        for: 30s
        labels: {severity: page}
"""


def test_each_gpu_has_its_own_for_state_notification_and_silence(config_for, make_evaluator, sink, clock):
    """One DCGM instance, three GPUs: `for`, firing, silences and notifications follow each label set."""
    from alerts.rules import load_rules_text
    from alerts.silences import SilenceIn, create_silence, parse_matcher

    source = MemorySource()
    ev = make_evaluator(source, load_rules_text(GPU_RULES), config_for(sink))
    with ev.factory() as s:
        silence = SilenceIn(
            matchers=[parse_matcher('gpu="2"')], startsAt=clock.now, endsAt=clock.now + 3600, createdBy="test"
        )
        create_silence(s, silence, now=clock.now)
        s.commit()
    usage = {"0": 0.95, "1": 0.75, "2": 0.97}

    def tick(n: int) -> None:
        for _ in range(n):
            for gpu, value in usage.items():
                labels = {"gpu": gpu, "UUID": f"GPU-{gpu}", "Hostname": "n1"}
                source.add("memory_usage", "dcgm:9400", clock.now, value, labels)
            assert ev.tick().error is None
            clock.advance(10)

    def states() -> dict[str, str]:
        return {a.labels["gpu"]: a.state for a in ev.states["MemoryPressure\0gpus"].active.values()}

    tick(4)  # 30s held by GPUs 0 and 2
    assert states() == {"0": "firing", "2": "firing"}
    usage["1"] = 0.99
    tick(2)  # GPU 1 pending on its own clock while 0 and 2 keep firing
    assert states() == {"0": "firing", "1": "pending", "2": "firing"}
    tick(3)
    assert states() == {"0": "firing", "1": "firing", "2": "firing"}
    assert sink.wait_for(2, 5)
    notified = [a["labels"] for r in sink.received for a in r.payload["alerts"] if a["status"] == "firing"]
    gpu0 = {"alertname": "MemoryPressure", "instance": "dcgm:9400", "gpu": "0", "UUID": "GPU-0", "Hostname": "n1"}
    assert {**gpu0, "severity": "page"} in notified
    assert {a["gpu"] for a in notified} == {"0", "1"}  # GPU 2 is silenced
    with ev.factory() as s:
        rows = s.execute(select(AlertState)).scalars().all()
        assert sorted(r.labels["gpu"] for r in rows) == ["0", "1", "2"]
        assert len({r.fingerprint for r in rows}) == 3


def test_the_loop_wakes_when_a_group_falls_due_and_counts_missed_evaluations(config_for, make_evaluator, sink, clock):
    from alerts.rules import load_rules_text

    groups = load_rules_text(
        "groups:\n"
        "  - {name: fast, interval: 250ms, rules: [{alert: Q, expr: queue_depth > 100}]}\n"
        "  - {name: slow, interval: 10s, rules: [{alert: R, expr: queue_depth > 1000}]}\n"
    )
    source = MemorySource()
    ev = make_evaluator(source, groups, config_for(sink))
    assert ev.wait_s(1.0) == 1.0  # no lease yet: the poll
    source.add("queue_depth", "a", clock.now, 5)
    assert ev.tick().leader
    assert ev.wait_s(1.0) == 0.25  # the fast group's next evaluation, not the poll
    clock.advance(0.1)
    assert ev.wait_s(1.0) == pytest.approx(0.15, abs=1e-6)
    assert ev.wait_s(0.05) == 0.05  # the poll still bounds it (lease renewal, delivery retries)
    clock.advance(0.15)
    ev.tick()
    assert ev.metrics.iterations_missed.labels("fast")._value.get() == 0
    clock.advance(1.0)  # due at +0.5, +0.75, +1.0 and +1.25 (now): one evaluation runs, three were missed
    ev.tick()
    assert ev.metrics.iterations_missed.labels("fast")._value.get() == 3
    assert ev.metrics.iterations_missed.labels("slow")._value.get() == 0
    counts = {
        s.labels["group"]: s.value
        for m in ev.metrics.registry.collect()
        if m.name == "kvpilot_alerts_rule_group_duration_seconds"
        for s in m.samples
        if s.name.endswith("_count")
    }
    assert counts == {"fast": 3, "slow": 1}
    clock.advance(2.0)
    assert ev.wait_s(1.0) == 0.0  # overdue: at once
