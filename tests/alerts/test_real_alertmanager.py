"""Against a real Alertmanager: kvpilot's forwarding is accepted, its fingerprints are Alertmanager's, and
kvpilot's own webhook body is the one Alertmanager sends, byte for byte (tests/alerts/amproc.py starts it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from alerts.alertmanager import fingerprint, group_key
from alerts.config import NotifierConfig, Receiver, Route
from alerts.memory_source import MemorySource
from alerts.metrics import AlertMetrics
from alerts.rules import load_rules_text
from alerts.runner import AlertEvaluator
from alerts.sink import WebhookSink, run_webhook_sink
from collector.db import make_engine, session_factory
from tests.alerts.amproc import EXTERNAL_URL, run_alertmanager, wait_received
from tests.alerts.conftest import FakeClock

# non-ASCII, a quote and a backslash (fingerprint and groupKey bytes); <, >, & and U+2028 (Go's JSON escapes)
INSTANCES = ("a", 'gpu-ü "1"\\x', "<b>&\u2028c")
RULES = """
groups:
  - name: am
    interval: 10s
    rules:
      - alert: QueueHigh
        expr: queue_depth > 100
        for: 30s
        labels: {severity: page}
        annotations: {summary: "{{ $labels.instance }} queue {{ $value }}", runbook: "https://runbooks/queue"}
"""


@pytest.fixture
def am_sink() -> Iterator[WebhookSink]:
    s = run_webhook_sink(port=0, log_payloads=False)
    yield s
    s.stop()


@pytest.fixture
def alertmanager(tmp_path: Path, am_sink: WebhookSink) -> Iterator[str]:
    config = f"""
route:
  receiver: hook
  group_by: ['alertname']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {am_sink.url}
        send_resolved: true
"""
    with run_alertmanager(tmp_path, config, EXTERNAL_URL) as url:
        yield url


def _status(status: str) -> Callable[[Any], bool]:
    """A notification of the whole group in `status`: the three alerts go to Alertmanager in one POST, yet on a
    busy machine its first flush (1 s after the group's first alert) held one of them once; the next, a group
    interval later, holds them all."""
    return lambda payload: payload.get("status") == status and len(payload.get("alerts", ())) == len(INSTANCES)


def test_forwarded_alerts_come_back_from_alertmanager_byte_for_byte_as_kvpilot_sends_them(
    alertmanager, am_sink, sink, sqlite_url
):
    # kvpilot's own webhook receiver gets Alertmanager's name and route, so both payloads can be compared whole
    config = NotifierConfig(
        receivers=[
            Receiver(name="hook", url=sink.url, secret="s3cret"),
            Receiver(name="am", url=f"{alertmanager}/api/v2/alerts", kind="alertmanager"),
        ],
        route=Route(
            receiver="hook", group_by=["alertname"], group_wait_s=0, group_interval_s=10, repeat_interval_s=3600
        ),
        external_url=EXTERNAL_URL,
    )
    clock = FakeClock(float(int(time.time())) - 120)  # behind real time: the forwarded endsAt stays ahead of it
    source = MemorySource()
    engine = make_engine(sqlite_url)
    ev = AlertEvaluator(
        session_factory(engine), load_rules_text(RULES), source, config, clock=clock, metrics=AlertMetrics()
    )

    def run(value: float, seconds: float) -> None:
        end = clock.now + seconds
        while clock.now < end:
            for instance in INSTANCES:
                source.add("queue_depth", instance, clock.now, value)
            assert ev.tick().error is None
            clock.advance(10)

    try:
        run(500, 40)  # fires at the fourth tick: notified to kvpilot's receiver and forwarded to Alertmanager
        am_firing = wait_received(am_sink, _status("firing"))
        ours_firing = wait_received(sink, _status("firing"), 5)
        run(10, 10)  # resolves
        am_resolved = wait_received(am_sink, _status("resolved"))
        ours_resolved = wait_received(sink, _status("resolved"), 5)
    finally:
        ev.step_down()
        if ev.delivery is not None:
            ev.delivery.close()
        engine.dispose()

    theirs = am_firing.payload
    assert [a["labels"]["instance"] for a in theirs["alerts"]] == sorted(INSTANCES)  # AM orders by instance
    for alert in theirs["alerts"]:
        assert alert["fingerprint"] == fingerprint(alert["labels"])  # Alertmanager's own fingerprint
    assert theirs["groupKey"] == group_key("{}", {"alertname": "QueueHigh"})
    assert "\\u003cb\\u003e\\u0026\\u2028c" in am_firing.body.decode()  # the escapes below are exercised
    for ours, am in ((ours_firing, am_firing), (ours_resolved, am_resolved)):
        # Nothing normalised: kvpilot's receiver has Alertmanager's name, route, group_by and external URL, and
        # the times Alertmanager sends are the ones kvpilot forwarded to it.
        assert ours.body.decode("utf-8") == am.body.decode("utf-8")
        assert ours.body.endswith(b"}\n")
