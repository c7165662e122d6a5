"""The alerts API's second round of hardening, on SQLite and PostgreSQL.

Docs are not public once a token is set; non-finite numbers and out-of-range dates, and control characters
in strings (NUL cannot be stored on PostgreSQL: it came back as a 503 quoting the SQL) are 422 naming the
field; a database error never echoes SQL; a silence cannot start in 9999, and DELETE expires a pending one
so it stops counting under the cap (Alertmanager's semantics).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from alerts.alertmanager import rfc3339
from alerts.api import create_api_app
from alerts.settings import AlertsSettings
from collector.db import is_sqlite, make_engine
from tests.alerts.conftest import T0

DAY = 86400.0
DOCS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture
def client(db_url, clock):
    with TestClient(create_api_app(db_url, clock=clock)) as c:
        yield c


def _silence(**kw):
    body = {
        "matchers": [{"name": "alertname", "value": "QueueHigh"}],
        "startsAt": rfc3339(T0),
        "endsAt": rfc3339(T0 + 3600),
        "createdBy": "ops",
        "comment": "maintenance",
    }
    body.update(kw)
    return body


def _post(client, body):
    return client.post(
        "/api/v2/silences", content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"}
    )


def _fields(response) -> set[tuple[str, ...]]:
    assert response.status_code == 422, (response.status_code, response.text[:300])
    return {tuple(str(p) for p in e["loc"]) for e in response.json()["detail"]}


# --- docs ----------------------------------------------------------------------------------------------


def test_docs_are_not_public_once_a_token_is_set(sqlite_url, clock):
    with TestClient(create_api_app(sqlite_url, clock=clock, token="t0ken")) as c:
        for path in DOCS:
            assert c.get(path).status_code == 404, path
            assert c.get(path, headers={"Authorization": "Bearer t0ken"}).status_code == 404, path
    with TestClient(create_api_app(sqlite_url, clock=clock)) as c:  # loopback without a token: served
        assert all(c.get(path).status_code == 200 for path in DOCS)
    public = AlertsSettings(public_docs=True)
    with TestClient(create_api_app(sqlite_url, clock=clock, token="t0ken", settings=public)) as c:
        assert all(c.get(path).status_code == 200 for path in DOCS)


def test_docs_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVPILOT_ALERTS_PUBLIC_DOCS", "true")
    assert AlertsSettings().public_docs is True


# --- numbers and dates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["startsAt", "endsAt"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e20, "10000-01-01T00:00:00Z"])
def test_non_finite_and_out_of_range_times_are_422_naming_the_field(client, field, value):
    response = _post(client, _silence(**{field: value}))
    assert ("body", field) in _fields(response)
    assert "input" not in response.json()["detail"][0]  # the refused value is never echoed


def test_a_silence_cannot_start_in_9999(client):
    far = _post(client, _silence(startsAt="9999-01-01T00:00:00Z", endsAt="9999-01-02T00:00:00Z"))
    assert ("body", "startsAt") in _fields(far)
    month = _silence(startsAt=rfc3339(T0 + 31 * DAY), endsAt=rfc3339(T0 + 32 * DAY))
    assert ("body", "startsAt") in _fields(_post(client, month))
    soon = _post(client, _silence(startsAt=rfc3339(T0 + 29 * DAY), endsAt=rfc3339(T0 + 30 * DAY)))
    assert soon.status_code == 200, soon.text


# --- control characters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"createdBy": "o\x00ps"}, ("body", "createdBy")),
        ({"createdBy": "ops\nadmin"}, ("body", "createdBy")),
        ({"createdBy": "o\x1bps"}, ("body", "createdBy")),
        ({"comment": "see\x00ticket"}, ("body", "comment")),
        ({"matchers": [{"name": "alertname", "value": "Q\x00"}]}, ("body", "matchers", "0", "value")),
        ({"id": "\x00"}, ("body", "id")),
    ],
)
def test_control_characters_are_422_naming_the_field(client, patch, loc):
    response = _post(client, _silence(**patch))
    assert loc in _fields(response)
    assert "SELECT" not in response.text and "INSERT" not in response.text
    assert client.get("/api/v2/silences").json() == []


def test_tabs_and_newlines_are_fine_in_a_comment(client):
    assert _post(client, _silence(comment="line one\n\tline two")).status_code == 200


def test_a_control_character_in_a_path_id_is_404(client):
    for method in (client.get, client.delete):
        assert method("/api/v2/silence/a%00b").status_code == 404


# --- database errors -----------------------------------------------------------------------------------


def test_a_database_error_is_answered_without_its_sql(db_url, clock, caplog):
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE alert_silences RENAME TO alert_silences_away"))
        with TestClient(create_api_app(engine=engine, clock=clock)) as c:
            listed = c.get("/api/v2/silences")
            created = _post(c, _silence())
        for answer in (listed, created):
            # SQLite calls a missing table an OperationalError, which reads as "unavailable"
            assert answer.status_code == (503 if is_sqlite(db_url) else 500)
            assert answer.json()["detail"] in (
                "database error (logged by the server)",
                "database unavailable; retry later",
            )
            assert "SELECT" not in answer.text and "INSERT" not in answer.text
        assert "alert_silences" in caplog.text  # the details are in the log line
    finally:
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE alert_silences_away RENAME TO alert_silences"))
        engine.dispose()


def test_an_unavailable_database_is_503_with_retry_after(db_url, clock, tmp_path: Path):
    # a directory is no SQLite file; nothing listens on port 1
    url = f"sqlite:///{tmp_path}" if is_sqlite(db_url) else "postgresql+psycopg://kvpilot:secret@127.0.0.1:1/none"
    with TestClient(create_api_app(url, clock=clock)) as c:
        answer = c.get("/api/v2/silences")
    assert answer.status_code == 503 and answer.headers["Retry-After"]
    assert answer.json() == {"detail": "database unavailable; retry later"}


# --- pending silences ----------------------------------------------------------------------------------


def test_delete_expires_a_pending_silence_and_frees_its_place(db_url, clock):
    settings = AlertsSettings(max_silences=2)
    with TestClient(create_api_app(db_url, clock=clock, settings=settings)) as c:
        later = _silence(startsAt=rfc3339(T0 + DAY), endsAt=rfc3339(T0 + 2 * DAY))
        ids = [_post(c, later).json()["silenceID"] for _ in range(2)]
        assert c.get(f"/api/v2/silence/{ids[0]}").json()["status"] == {"state": "pending"}
        assert _post(c, later).status_code == 429  # pending silences count
        assert c.delete(f"/api/v2/silence/{ids[0]}").status_code == 200
        expired = c.get(f"/api/v2/silence/{ids[0]}").json()
        assert expired["status"] == {"state": "expired"}
        assert expired["startsAt"] == expired["endsAt"] == rfc3339(T0)
        assert _post(c, later).status_code == 200  # its place is free
        clock.advance(1.5 * DAY)  # the other pending one is active now, then expired by DELETE
        assert c.get(f"/api/v2/silence/{ids[1]}").json()["status"] == {"state": "active"}
        assert c.delete(f"/api/v2/silence/{ids[1]}").status_code == 200
        ended = c.get(f"/api/v2/silence/{ids[1]}").json()
        assert ended["startsAt"] == rfc3339(T0 + DAY) and ended["endsAt"] == rfc3339(T0 + 1.5 * DAY)
