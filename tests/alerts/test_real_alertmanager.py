"""Against a real Alertmanager: kvpilot's forwarding is accepted, its fingerprints are Alertmanager's, and
kvpilot's own webhook payload is the one Alertmanager sends, field for field.

Needs `prometheus-alertmanager` (Debian package of that name) or `alertmanager` on PATH; skipped without
it, failed without it when KVPILOT_REQUIRE_ALERTMANAGER=1 (CI). Loopback only, bounded waits, the
process is killed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from alerts.alertmanager import fingerprint, group_key
from alerts.config import NotifierConfig, Receiver, Route
from alerts.memory_source import MemorySource
from alerts.metrics import AlertMetrics
from alerts.rules import load_rules_text
from alerts.runner import AlertEvaluator
from alerts.sink import WebhookSink, run_webhook_sink
from collector.db import make_engine, session_factory
from tests.alerts.conftest import FakeClock

EXTERNAL_URL = "http://localhost:9093"
INSTANCES = ("a", 'gpu-ü "1"\\x')  # non-ASCII, a quote and a backslash: the fingerprint and groupKey bytes
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


def _binary() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if found is None:
        reason = (
            "no Alertmanager binary (install the Debian package prometheus-alertmanager, or put `alertmanager` on PATH)"
        )
        if os.environ.get("KVPILOT_REQUIRE_ALERTMANAGER") == "1":
            pytest.fail(f"KVPILOT_REQUIRE_ALERTMANAGER=1 but {reason}")
        pytest.skip(reason)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def am_sink() -> Iterator[WebhookSink]:
    s = run_webhook_sink(port=0, log_payloads=False)
    yield s
    s.stop()


@pytest.fixture
def alertmanager(tmp_path: Path, am_sink: WebhookSink) -> Iterator[str]:
    binary = _binary()
    config = tmp_path / "alertmanager.yml"
    config.write_text(f"""
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
""")
    port = _free_port()
    log_path = tmp_path / "alertmanager.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.path={tmp_path / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                f"--web.external-url={EXTERNAL_URL}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"alertmanager exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"alertmanager not ready on {url} after 20 s:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_status(sink: WebhookSink, status: str, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for received in list(sink.received):
            if received.payload.get("status") == status:
                return received.payload
        sink.wait_for(len(sink.received) + 1, 0.1)
    raise AssertionError(f"no {status} notification within {timeout_s} s; got {[r.payload for r in sink.received]}")


def test_forwarded_alerts_come_back_from_alertmanager_exactly_as_kvpilot_sends_them(
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
        am_firing = _wait_status(am_sink, "firing")
        ours_firing = _wait_status(sink, "firing", 5)
        run(10, 10)  # resolves
        am_resolved = _wait_status(am_sink, "resolved")
        ours_resolved = _wait_status(sink, "resolved", 5)
    finally:
        ev.step_down()
        if ev.delivery is not None:
            ev.delivery.close()
        engine.dispose()

    assert len(am_firing["alerts"]) == 2
    for alert in am_firing["alerts"]:
        assert alert["fingerprint"] == fingerprint(alert["labels"])  # Alertmanager's own fingerprint
    assert {a["labels"]["instance"] for a in am_firing["alerts"]} == set(INSTANCES)
    assert am_firing["alerts"][0]["labels"] == {"alertname": "QueueHigh", "instance": INSTANCES[0], "severity": "page"}
    assert am_firing["groupKey"] == group_key("{}", {"alertname": "QueueHigh"})
    for ours, theirs in ((ours_firing, am_firing), (ours_resolved, am_resolved)):
        assert set(ours) == set(theirs)
        for ours_alert, their_alert in zip(ours["alerts"], theirs["alerts"], strict=True):
            assert set(ours_alert) == set(their_alert)
        differing = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
        assert not differing, differing  # field for field, values included
