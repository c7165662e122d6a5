"""Delivery under the lease: renewed and re-checked before each POST, timeouts inside the lease; backoff reset
when the receiver recovers; a group's stale backlog collapsed; two evaluators and a slow receiver page once."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
from sqlalchemy import select, update

from alerts.config import webhook_config
from alerts.delivery import DeliveryWorker
from alerts.memory_source import MemorySource
from alerts.metrics import AlertMetrics
from alerts.rules import load_rules_text
from alerts.runner import AlertEvaluator, start_evaluator
from alerts.sink import run_webhook_sink
from collector.db import make_engine, session_factory
from collector.schema import AlertEvaluatorLease, AlertNotification

FAST_RULES = """
groups:
  - name: fast
    interval: 10s
    rules:
      - alert: QueueHigh
        expr: queue_depth > 100
        labels: {severity: page}
"""


class Recorder:
    """An httpx transport that answers 200 and remembers each POST with its timeout and the lease row."""

    def __init__(self, factory, on_post=None) -> None:
        self.factory = factory
        self.on_post = on_post
        self.posts: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.factory() as s:
            lease = s.get(AlertEvaluatorLease, 1)
            seen = {"holder": lease.holder, "token": lease.token, "expires_at": lease.expires_at}
        self.posts.append({"key": request.headers["Idempotency-Key"], "timeout": request.extensions["timeout"], **seen})
        if self.on_post is not None:
            self.on_post(len(self.posts))
        return httpx.Response(200)


def _evaluator(db_url, clock, config, recorder_factory, *, holder="a", ttl=15.0, **worker_kw):
    engine = make_engine(db_url)
    factory = session_factory(engine)
    recorder = recorder_factory(factory)
    metrics = AlertMetrics()
    worker = DeliveryWorker(
        factory,
        {r.name: r for r in config.receivers},
        clock=clock,
        metrics=metrics,
        client=httpx.Client(transport=httpx.MockTransport(recorder)),
        rng=random.Random(3),
        lease_ttl_s=ttl,
        **worker_kw,
    )
    ev = AlertEvaluator(
        factory,
        load_rules_text(FAST_RULES),
        MemorySource(),
        config,
        clock=clock,
        holder=holder,
        lease_ttl_s=ttl,
        metrics=metrics,
        delivery=worker,
    )
    return ev, recorder, engine


def _config(url="http://receiver.invalid/", **kw):
    defaults = {"group_wait_s": 0.0, "group_interval_s": 10.0, "repeat_interval_s": 3600.0}
    defaults.update(kw)
    return webhook_config([url], group_by=["alertname", "instance"], **defaults)


def test_lease_renewed_before_each_post_and_timeout_inside_it(db_url, clock):
    config = _config()
    config.receivers[0].timeout_s = 60.0  # longer than the lease: must be cut to what the lease has left
    ev, recorder, engine = _evaluator(db_url, clock, config, Recorder, ttl=15.0)
    delivery, ev.delivery = ev.delivery, None  # evaluate only: deliver by hand below
    try:
        for instance in ("a", "b"):
            ev.source.add("queue_depth", instance, clock.now, 500.0)
        assert len(ev.tick().notifications) == 2
        lease = ev.lease
        clock.advance(12)  # 3 s of lease left when the worker starts
        delivery.run_once(lease)
        assert len(recorder.posts) == 2
        for post in recorder.posts:
            assert post["holder"] == "a" and post["expires_at"] >= clock.now + 15.0 - 1e-6  # renewed just before
            assert post["timeout"]["read"] is not None and post["timeout"]["read"] <= 15.0 * 0.8
        delivery.close()
    finally:
        engine.dispose()


def test_no_post_once_the_lease_is_lost_mid_batch(db_url, clock):
    def recorder_factory(factory):
        def take_over(count: int) -> None:
            if count == 1:  # another evaluator takes over while the first POST is answered
                with factory() as s:
                    s.execute(update(AlertEvaluatorLease).values(holder="b", token=AlertEvaluatorLease.token + 1))
                    s.commit()

        return Recorder(factory, take_over)

    config = _config()
    ev, recorder, engine = _evaluator(db_url, clock, config, recorder_factory)
    try:
        for instance in ("a", "b", "c"):
            ev.source.add("queue_depth", instance, clock.now, 500.0)
        ev.tick()
        assert len(recorder.posts) == 1  # the second and third were never sent under a lost lease
        with ev.factory() as s:
            statuses = s.execute(select(AlertNotification.status)).scalars().all()
        assert sorted(statuses) == ["pending", "pending", "pending"]  # the first: recorded by nobody, retried
        ev.delivery.close()
    finally:
        engine.dispose()


def test_backoff_resets_when_the_receiver_answers_again(config_for, make_evaluator, clock):
    sink = run_webhook_sink(port=0, secret="s3cret", log_payloads=False)
    sink.status_code = 503
    try:
        source = MemorySource()
        config = config_for(sink, group_by=["alertname", "instance"])
        ev = make_evaluator(source, load_rules_text(FAST_RULES), config, base_backoff_s=1.0, max_backoff_s=300.0)
        instances = [f"i{k}" for k in range(5)]
        for _ in range(60):  # ten minutes down: every row backs off towards the 300 s cap
            for instance in instances:
                source.add("queue_depth", instance, clock.now, 500.0)
            ev.tick()
            clock.advance(10)
        sink.status_code = 200
        first = None
        for step in range(400):
            for instance in instances:
                source.add("queue_depth", instance, clock.now, 500.0)
            ev.tick()
            if sink.received and first is None:
                first = step
            if len(sink.received) >= 5:
                break
            clock.advance(1)
        assert first is not None and len(sink.received) == 5
        assert step - first <= 2, f"backlog took {step - first} s after the first 2xx"
    finally:
        sink.stop()


def test_stale_backlog_of_a_group_collapses_to_its_newest(config_for, make_evaluator, clock):
    sink = run_webhook_sink(port=0, secret="s3cret", log_payloads=False)
    sink.status_code = 503
    try:
        source = MemorySource()
        ev = make_evaluator(source, load_rules_text(FAST_RULES), config_for(sink), max_backoff_s=600.0)
        for k in range(9):  # firing, resolved, firing, ... one notification per flush while the receiver is down
            source.add("queue_depth", "a", clock.now, 500.0 if k % 2 == 0 else 10.0)
            ev.tick()
            clock.advance(10)
        sink.status_code = 200
        for _ in range(60):
            source.add("queue_depth", "a", clock.now, 500.0)
            ev.tick()
            clock.advance(10)
        assert sink.wait_for(1, 5)
        time.sleep(0.2)
        assert len(sink.received) == 1 and sink.received[0].payload["status"] == "firing"
        with ev.factory() as s:
            rows = s.execute(select(AlertNotification).order_by(AlertNotification.id)).scalars().all()
        assert [r.status for r in rows] == ["expired"] * 8 + ["delivered"]
        assert all(r.last_error.startswith("superseded by") for r in rows[:-1])
        assert ev.metrics.superseded.labels("webhook")._value.get() == 8
    finally:
        sink.stop()


def test_backlog_keeps_a_resolution_the_newest_does_not_carry(config_for, make_evaluator, clock):
    """Group by alertname: `a` resolves (it leaves the group after that flush), then `c` fires. The newer
    notification does not mention `a`, so the older one is still sent first: the receiver learns `a` resolved."""
    sink = run_webhook_sink(port=0, secret="s3cret", log_payloads=False)
    try:
        source = MemorySource()
        ev = make_evaluator(source, load_rules_text(FAST_RULES), config_for(sink), max_backoff_s=600.0)
        values = {"a": 500.0, "b": 500.0}
        for phase in ({"a": 500.0, "b": 500.0}, {"a": 10.0, "b": 500.0}, {"b": 500.0, "c": 500.0}):
            if phase.get("a") == 10.0:
                sink.status_code = 503
            values = phase
            for instance, value in values.items():
                source.add("queue_depth", instance, clock.now, value)
            ev.tick()
            clock.advance(10)
        sink.status_code = 200
        for _ in range(60):
            for instance, value in values.items():
                source.add("queue_depth", instance, clock.now, value)
            ev.tick()
            clock.advance(10)
        assert sink.wait_for(3, 5)
        statuses = [{a["labels"]["instance"]: a["status"] for a in r.payload["alerts"]} for r in sink.received]
        assert statuses == [
            {"a": "firing", "b": "firing"},
            {"a": "resolved", "b": "firing"},
            {"b": "firing", "c": "firing"},
        ]
    finally:
        sink.stop()


def test_two_evaluators_and_a_slow_receiver_post_each_notification_once(db_url, tmp_path):
    """Two `kvpilot alerts run`s on one database, a 1 s lease and a receiver that takes 0.2 s per POST."""
    rules = tmp_path / "rules.yml"
    rules.write_text(FAST_RULES.replace("10s", "100ms"))
    sink = run_webhook_sink(port=0, log_payloads=False)
    sink.delay_s = 0.2
    source = MemorySource()
    instances = [f"i{k:02d}" for k in range(16)]
    now = time.time()
    for instance in instances:
        source.add("queue_depth", instance, now, 500.0)
    config = _config(sink.url, group_wait_s=0.0)
    config.receivers[0].timeout_s = 0.5
    handles = []
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            for instance in instances:
                source.add("queue_depth", instance, time.time(), 500.0)
            stop.wait(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        for _ in range(2):
            handles.append(
                start_evaluator(
                    db_url, rule_files=[rules], source=source, notifier=config, poll_s=0.05, lease_ttl_s=2.0
                )
            )
        assert sink.wait_for(len(instances), 30)
        watch = make_engine(db_url)
        try:  # until every row is recorded delivered: one sent but not recorded is sent again first
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with watch.connect() as conn:
                    statuses = conn.execute(select(AlertNotification.status)).scalars().all()
                if len(statuses) == len(instances) and set(statuses) == {"delivered"}:
                    break
                time.sleep(0.1)
        finally:
            watch.dispose()
    finally:
        stop.set()
        for handle in handles:
            handle.stop()
        sink.stop()
    keys = [r.idempotency_key for r in sink.received]
    assert len(keys) == len(set(keys)) == len(instances)
    assert sink.duplicates == 0, f"{sink.duplicates} duplicate POSTs"
    bodies = [json.loads(r.body) for r in sink.received]
    assert sorted(b["alerts"][0]["labels"]["instance"] for b in bodies) == instances
