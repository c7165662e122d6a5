"""The Alertmanager API v2 subset: silences CRUD, alerts, health, metrics, auth; on SQLite and PostgreSQL."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from alerts.alertmanager import fingerprint, rfc3339
from alerts.api import create_api_app
from alerts.memory_source import MemorySource
from alerts.runner import start_evaluator
from tests.alerts.conftest import T0


@pytest.fixture
def client(db_url, clock):
    app = create_api_app(db_url, clock=clock)
    with TestClient(app) as c:
        yield c


def _silence(**kw):
    body = {
        "matchers": [{"name": "alertname", "value": "QueueHigh", "isRegex": False, "isEqual": True}],
        "startsAt": rfc3339(T0),
        "endsAt": rfc3339(T0 + 3600),
        "createdBy": "ops",
        "comment": "maintenance",
    }
    body.update(kw)
    return body


def test_silence_create_list_get_update_expire(client, clock):
    created = client.post("/api/v2/silences", json=_silence())
    assert created.status_code == 200, created.text
    sid = created.json()["silenceID"]
    listed = client.get("/api/v2/silences").json()
    assert [s["id"] for s in listed] == [sid]
    got = listed[0]
    assert set(got) == {"id", "status", "updatedAt", "matchers", "startsAt", "endsAt", "createdBy", "comment"}
    assert got["status"] == {"state": "active"} and got["startsAt"] == rfc3339(T0)
    assert got["endsAt"] == "2027-01-15T09:00:00Z" and got["createdBy"] == "ops"
    assert got["matchers"] == [{"name": "alertname", "value": "QueueHigh", "isRegex": False, "isEqual": True}]
    assert client.get(f"/api/v2/silence/{sid}").json() == got
    # an `id` in the body updates that silence (Alertmanager's semantics), isEqual defaults to true
    updated = client.post(
        "/api/v2/silences",
        json=_silence(
            id=sid,
            comment="longer",
            endsAt=rfc3339(T0 + 7200),
            matchers=[{"name": "instance", "value": "gpu.*", "isRegex": True}],
        ),
    )
    assert updated.json() == {"silenceID": sid}
    again = client.get(f"/api/v2/silence/{sid}").json()
    assert again["comment"] == "longer" and again["matchers"][0]["isEqual"] is True
    assert client.get("/api/v2/silences", params={"filter": 'instance=~"gpu.*"'}).json()[0]["id"] == sid
    assert client.get("/api/v2/silences", params={"filter": "instance=other"}).json() == []
    clock.advance(60)
    assert client.delete(f"/api/v2/silence/{sid}").status_code == 200
    expired = client.get(f"/api/v2/silence/{sid}").json()
    assert expired["status"]["state"] == "expired" and expired["endsAt"] == rfc3339(T0 + 60)
    assert [s["id"] for s in client.get("/api/v2/silences").json()] == [sid]  # expired ones are listed too


def test_bad_input_is_422_naming_the_field_and_unknown_id_404(client):
    def fields(response):
        assert response.status_code == 422, response.text
        return {tuple(str(p) for p in e["loc"]) for e in response.json()["detail"]}

    assert ("body", "endsAt") in fields(client.post("/api/v2/silences", json=_silence(endsAt=rfc3339(T0 - 1))))
    assert ("body", "matchers") in fields(client.post("/api/v2/silences", json=_silence(matchers=[])))
    assert ("body", "createdBy") in fields(client.post("/api/v2/silences", json=_silence(createdBy="")))
    assert ("body", "startsAt") in fields(client.post("/api/v2/silences", json=_silence(startsAt="yesterday")))
    bad_regex = _silence(matchers=[{"name": "instance", "value": "(", "isRegex": True}])
    assert ("body", "matchers", "0") in fields(client.post("/api/v2/silences", json=bad_regex))
    assert ("query", "filter") in fields(client.get("/api/v2/silences", params={"filter": "no-operator"}))
    missing = "00000000-0000-0000-0000-000000000000"
    assert client.delete(f"/api/v2/silence/{missing}").status_code == 404
    assert client.get(f"/api/v2/silence/{missing}").status_code == 404
    assert client.post("/api/v2/silences", json=_silence(id=missing)).status_code == 404


def test_bearer_token(db_url, clock):
    with TestClient(create_api_app(db_url, clock=clock, token="t0ken")) as c:
        assert c.get("/-/healthy").text == "OK"
        assert c.get("/api/v2/silences").status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/api/v2/silences", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/v2/silences", headers={"Authorization": "Bearer t0ken"}).json() == []


def test_alerts_and_metrics_served_by_the_evaluator(db_url, groups, tmp_path):
    """A real uvicorn on a free loopback port, started by start_evaluator(api_port=0)."""
    rules = tmp_path / "rules.yml"
    rules.write_text("""
groups:
  - name: fast
    interval: 100ms
    rules:
      - alert: QueueHigh
        expr: queue_depth > 100
        for: 1h
        labels: {severity: page}
      - alert: QueueSome
        expr: queue_depth > 10
        labels: {severity: info}
""")
    source = MemorySource()
    import time

    source.add("queue_depth", "a", time.time(), 500.0)
    handle = start_evaluator(db_url, rule_files=[rules], source=source, poll_s=0.05, api_port=0, api_token="tok")
    try:
        assert handle.api_url and handle.api_url.startswith("http://127.0.0.1:")
        headers = {"Authorization": "Bearer tok"}
        with httpx.Client(base_url=handle.api_url, headers=headers, timeout=5) as http:
            alerts: list = []
            deadline = time.monotonic() + 10
            while len(alerts) < 2 and time.monotonic() < deadline:
                alerts = http.get("/api/v2/alerts").json()
                time.sleep(0.05)
            assert sorted((a["labels"]["alertname"], a["alertState"]) for a in alerts) == [
                ("QueueHigh", "pending"),
                ("QueueSome", "firing"),
            ]
            firing = next(a for a in alerts if a["alertState"] == "firing")
            assert firing["fingerprint"] == fingerprint(firing["labels"])
            assert firing["labels"] == {"alertname": "QueueSome", "instance": "a", "severity": "info"}
            assert firing["status"] == {"state": "active", "silencedBy": [], "inhibitedBy": []}
            assert "graph?g0.expr=queue_depth" in firing["generatorURL"]
            assert [a["labels"]["alertname"] for a in http.get("/api/v2/alerts?pending=false").json()] == ["QueueSome"]
            now = time.time()
            sid = http.post(
                "/api/v2/silences",
                json={
                    "matchers": [{"name": "severity", "value": "info", "isRegex": False}],
                    "startsAt": rfc3339(now - 1),
                    "endsAt": rfc3339(now + 600),
                    "createdBy": "test",
                },
            ).json()["silenceID"]
            muted = http.get("/api/v2/alerts", params={"filter": "alertname=QueueSome"}).json()
            assert muted[0]["status"] == {"state": "suppressed", "silencedBy": [sid], "inhibitedBy": []}
            assert http.get("/api/v2/alerts", params={"silenced": "false", "pending": "false"}).json() == []
            page = http.get("/metrics")
            assert page.status_code == 200
            assert 'kvpilot_alerts_rule_evaluations_total{rule="QueueSome"}' in page.text
            assert http.get("/-/healthy", headers={}).text == "OK"
    finally:
        handle.stop()
