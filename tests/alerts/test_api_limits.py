"""The alerts API's trust boundary: a token off loopback, bounded silences, bounded input, RE2 patterns."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from alerts.alertmanager import rfc3339
from alerts.api import create_api_app
from alerts.memory_source import MemorySource
from alerts.runner import start_evaluator
from tests.alerts.conftest import T0

DAY = 86400.0


@pytest.fixture
def client(sqlite_url, clock):
    with TestClient(create_api_app(sqlite_url, clock=clock)) as c:
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


def _fields(response) -> set[tuple[str, ...]]:
    assert response.status_code == 422, (response.status_code, response.text[:300])
    return {tuple(str(p) for p in e["loc"]) for e in response.json()["detail"]}


# --- finding 1: no token off loopback ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "alerts.example.com", ""])
def test_non_loopback_api_without_token_is_refused(sqlite_url, host):
    with pytest.raises(ValueError, match="KVPILOT_ALERTS_API_TOKEN"):
        handle = start_evaluator(sqlite_url, source=MemorySource(), api_port=0, api_host=host)
        handle.stop()


def test_non_loopback_api_with_token_serves_and_guards_writes(sqlite_url):
    import httpx

    handle = start_evaluator(sqlite_url, source=MemorySource(), api_port=0, api_host="0.0.0.0", api_token="t0k")
    try:
        assert handle.api is not None
        url = f"http://127.0.0.1:{handle.api.port}"
        import time

        now = time.time()
        body = _silence(startsAt=rfc3339(now), endsAt=rfc3339(now + 600))
        assert httpx.post(f"{url}/api/v2/silences", json=body, timeout=5).status_code == 401
        assert httpx.delete(f"{url}/api/v2/silence/x", timeout=5).status_code == 401
        ok = httpx.post(f"{url}/api/v2/silences", json=body, headers={"Authorization": "Bearer t0k"}, timeout=5)
        assert ok.status_code == 200, ok.text
    finally:
        handle.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_api_needs_no_token(host):
    from alerts.api_server import check_api_bind

    check_api_bind(host, None)


def test_cli_refuses_public_bind_without_token(sqlite_url, monkeypatch):
    from typer.testing import CliRunner

    from kvpilot.cli import app

    monkeypatch.delenv("KVPILOT_ALERTS_API_TOKEN", raising=False)
    result = CliRunner().invoke(
        app,
        ["alerts", "run", "--db", sqlite_url, "--api-port", "0", "--api-host", "0.0.0.0", "--duration-s", "1"],
    )
    assert result.exit_code == 1 and "KVPILOT_ALERTS_API_TOKEN" in result.output, result.output


# --- finding 2: a silence that mutes everything, or forever -------------------------------------------


@pytest.mark.parametrize(
    "matchers",
    [
        [{"name": "alertname", "value": ".*", "isRegex": True}],
        [{"name": "instance", "value": "x", "isEqual": False}],
        [{"name": "instance", "value": ""}],
        [
            {"name": "alertname", "value": ".+", "isRegex": True, "isEqual": False},
            {"name": "a", "value": "b|", "isRegex": True},
        ],
    ],
)
def test_silence_matching_every_alert_is_refused(client, matchers):
    response = client.post("/api/v2/silences", json=_silence(matchers=matchers))
    assert ("body", "matchers") in _fields(response)
    assert "at least one matcher must not match the empty string" in response.text


def test_silence_duration_is_bounded(client, clock):
    forever = client.post("/api/v2/silences", json=_silence(endsAt="2099-01-01T00:00:00Z"))
    assert ("body", "endsAt") in _fields(forever)
    assert "30 days" in forever.text
    ok = client.post("/api/v2/silences", json=_silence(endsAt=rfc3339(T0 + 30 * DAY)))
    assert ok.status_code == 200, ok.text
    # an update is bounded too, and a start in the past does not count against the bound
    sid = ok.json()["silenceID"]
    update = _silence(id=sid, startsAt=rfc3339(T0 - 300 * DAY), endsAt=rfc3339(T0 + 31 * DAY))
    assert ("body", "endsAt") in _fields(client.post("/api/v2/silences", json=update))
    old_start = _silence(startsAt=rfc3339(T0 - 300 * DAY), endsAt=rfc3339(T0 + DAY))
    assert client.post("/api/v2/silences", json=old_start).status_code == 200


def test_silence_duration_bound_is_a_setting(sqlite_url, clock):
    from alerts.settings import AlertsSettings

    settings = AlertsSettings(max_silence_duration_s=3600)
    with TestClient(create_api_app(sqlite_url, clock=clock, settings=settings)) as c:
        assert ("body", "endsAt") in _fields(c.post("/api/v2/silences", json=_silence(endsAt=rfc3339(T0 + 3601))))
        assert c.post("/api/v2/silences", json=_silence(endsAt=rfc3339(T0 + 3600))).status_code == 200


def test_cli_silence_add_is_bounded_too(sqlite_url):
    from typer.testing import CliRunner

    from kvpilot.cli import app

    runner = CliRunner()
    everything = runner.invoke(app, ["alerts", "silence", "add", "alertname=~.*", "--db", sqlite_url])
    assert everything.exit_code == 2 and "empty string" in everything.output
    long = runner.invoke(app, ["alerts", "silence", "add", "alertname=X", "--duration", "90d", "--db", sqlite_url])
    assert long.exit_code == 2 and "30 days" in long.output


# --- finding 3 (API side): patterns are RE2 -----------------------------------------------------------


@pytest.mark.parametrize("pattern", [r"(a)\1", "(?=a)b", "(?<!a)b", "(a{1000}){1000}"])
def test_unsupported_or_invalid_regex_is_422_naming_the_matcher(client, pattern):
    matchers = [{"name": "alertname", "value": "X"}, {"name": "instance", "value": pattern, "isRegex": True}]
    assert ("body", "matchers", "1") in _fields(client.post("/api/v2/silences", json=_silence(matchers=matchers)))
    assert ("query", "filter") in _fields(client.get("/api/v2/alerts", params={"filter": f'instance=~"{pattern}"'}))


def test_catastrophic_regex_is_accepted_and_cheap(client):
    matchers = [{"name": "instance", "value": r"(.*.*.*)*\d", "isRegex": True}]
    assert client.post("/api/v2/silences", json=_silence(matchers=matchers)).status_code == 200


# --- finding 4: every field and the body are bounded --------------------------------------------------


def test_body_over_the_limit_is_413_before_parsing(client):
    huge = client.post("/api/v2/silences", json=_silence(comment="x" * (1 << 20)))
    assert huge.status_code == 413 and "body" in huge.text

    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    streamed = client.post("/api/v2/silences", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413


def test_field_limits(client):
    assert ("body", "comment") in _fields(client.post("/api/v2/silences", json=_silence(comment="c" * 5000)))
    assert ("body", "createdBy") in _fields(client.post("/api/v2/silences", json=_silence(createdBy="o" * 201)))
    many = [{"name": f"l{i}", "value": "v"} for i in range(33)]
    assert ("body", "matchers") in _fields(client.post("/api/v2/silences", json=_silence(matchers=many)))
    long_name = [{"name": "n" * 300, "value": "v"}]
    assert ("body", "matchers", "0", "name") in _fields(
        client.post("/api/v2/silences", json=_silence(matchers=long_name))
    )
    long_value = [{"name": "instance", "value": "v" * 2000}]
    assert ("body", "matchers", "0", "value") in _fields(
        client.post("/api/v2/silences", json=_silence(matchers=long_value))
    )
    bad_name = [{"name": "in stance", "value": "v"}]
    assert ("body", "matchers", "0", "name") in _fields(
        client.post("/api/v2/silences", json=_silence(matchers=bad_name))
    )
    assert ("body", "id") in _fields(client.post("/api/v2/silences", json=_silence(id="i" * 100)))
    filters = [f"l{i}=v" for i in range(33)]
    assert ("query", "filter") in _fields(client.get("/api/v2/silences", params={"filter": filters}))
    assert client.get("/api/v2/silence/" + "i" * 100).status_code == 404


def test_unexpired_silences_are_bounded(sqlite_url, clock):
    from alerts.settings import AlertsSettings

    settings = AlertsSettings(max_silences=3)
    with TestClient(create_api_app(sqlite_url, clock=clock, settings=settings)) as c:
        ids = [c.post("/api/v2/silences", json=_silence()).json()["silenceID"] for _ in range(3)]
        full = c.post("/api/v2/silences", json=_silence())
        assert full.status_code == 429 and "Retry-After" in full.headers
        assert c.post("/api/v2/silences", json=_silence(id=ids[0], comment="update")).status_code == 200
        assert c.delete(f"/api/v2/silence/{ids[0]}").status_code == 200
        assert c.post("/api/v2/silences", json=_silence()).status_code == 200
