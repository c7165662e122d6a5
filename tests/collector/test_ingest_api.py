"""POST /v1/ingest through the real ASGI app (SQLite); bad input stores nothing. Targets: test_target_api.py."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from collector.db import make_engine
from collector.schema import IngestBatch, RequestRow, SampleRow, StepRow
from collector.server import create_app
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def settings(sqlite_url: str) -> CollectorSettings:
    return CollectorSettings(
        db_url=sqlite_url,
        ingest_token=TOKEN,
        scrape_enabled=False,
        max_batch_bytes=64 * 1024,
        max_decompressed_bytes=256 * 1024,
        max_batch_events=500,
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def stored(settings: CollectorSettings) -> dict[str, int]:
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        counts = {
            m.__tablename__: conn.execute(select(func.count()).select_from(m.__table__)).scalar_one()
            for m in (IngestBatch, RequestRow, StepRow, SampleRow)
        }
    engine.dispose()
    return counts


NOTHING = {"ingest_batches": 0, "requests": 0, "steps": 0, "samples": 0}


def post(client: TestClient, content: bytes, **headers: str):
    return client.post("/v1/ingest", content=content, headers={"Content-Type": "application/json", **headers})


def test_accepts_batch_then_reports_duplicate(client: TestClient, settings: CollectorSettings) -> None:
    body = ev.body(ev.mixed(12))
    first = post(client, body, **AUTH, **{"Idempotency-Key": "b-1"})
    assert first.status_code == 202, first.text
    assert first.json() == {"batch_id": 1, "idempotency_key": "b-1", "events": 12, "duplicate": False}
    again = post(client, body, **AUTH, **{"Idempotency-Key": "b-1"})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert stored(settings) == {"ingest_batches": 1, "requests": 3, "steps": 3, "samples": 3}


def test_key_in_body_dedups_too(client: TestClient, settings: CollectorSettings) -> None:
    body = ev.body(ev.mixed(4), key="in-body")
    assert post(client, body, **AUTH).status_code == 202
    assert post(client, body, **AUTH).json()["duplicate"] is True
    assert stored(settings)["ingest_batches"] == 1


def test_gzip_body_is_accepted(client: TestClient, settings: CollectorSettings) -> None:
    resp = post(client, gzip.compress(ev.body(ev.mixed(8))), **AUTH, **{"Content-Encoding": "gzip"})
    assert resp.status_code == 202, resp.text
    assert stored(settings)["steps"] == 2


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [({}, 401, "unauthorized"), ({"Authorization": "Bearer nope"}, 403, "forbidden")],
)
def test_auth(client: TestClient, settings: CollectorSettings, headers: dict, status: int, reason: str) -> None:
    resp = post(client, ev.body(ev.mixed(4)), **headers)
    assert resp.status_code == status
    if status == 401:
        assert resp.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/targets", headers=headers).status_code == status
    assert stored(settings) == NOTHING
    assert f'kvpilot_collector_ingest_rejected_total{{reason="{reason}"}} 2.0' in client.get("/metrics").text


def test_bad_event_rejects_whole_batch_with_index_and_field(client: TestClient, settings: CollectorSettings) -> None:
    events = ev.mixed(20)
    events[13] = {**events[13], "prompt_tokens": "many"}
    resp = post(client, ev.body(events), **AUTH)
    assert resp.status_code == 422
    assert resp.json()["errors"][0]["loc"] == "events[13].prompt_tokens"
    assert "events[13].prompt_tokens" in resp.json()["detail"]
    assert stored(settings) == NOTHING


def test_negative_swap_seconds_get_422_naming_the_field(client: TestClient, settings: CollectorSettings) -> None:
    events = ev.mixed(8)
    events[4] = {**events[4], "swap_s": -1.0}
    resp = post(client, ev.body(events), **AUTH)
    assert resp.status_code == 422, resp.text
    assert resp.json()["errors"][0]["loc"] == "events[4].swap_s"
    assert stored(settings) == NOTHING


@pytest.mark.parametrize(
    "patch",
    [{"type": "histogram"}, {"v": 99}, {"ts": "yesterday"}, {"instance": None}, {"extra_field": True}],
    ids=["unknown-type", "unknown-version", "wrong-type", "null", "unknown-field"],
)
def test_invalid_events_get_422_and_store_nothing(client: TestClient, settings: CollectorSettings, patch: dict) -> None:
    events = ev.mixed(4)
    events[1] = {**events[1], **patch}
    resp = post(client, ev.body(events), **AUTH)
    assert resp.status_code == 422, resp.text
    assert resp.json()["errors"][0]["loc"].startswith("events[1]")
    assert stored(settings) == NOTHING


@pytest.mark.parametrize("content", [b"", b"not json", b"[]", b'{"events": {}}', b'{"events": [1]}', b'{"evnts": []}'])
def test_malformed_bodies_get_422(client: TestClient, settings: CollectorSettings, content: bytes) -> None:
    assert post(client, content, **AUTH).status_code == 422
    assert stored(settings) == NOTHING


def test_oversize_body_is_413(client: TestClient, settings: CollectorSettings) -> None:
    big = ev.body(ev.mixed(400, instance="x" * 150))
    assert len(big) > settings.max_batch_bytes
    assert post(client, big, **AUTH).status_code == 413
    assert stored(settings) == NOTHING


def test_too_many_events_is_413(client: TestClient, settings: CollectorSettings) -> None:
    resp = post(client, gzip.compress(ev.body(ev.mixed(501))), **AUTH, **{"Content-Encoding": "gzip"})
    assert resp.status_code == 413
    assert stored(settings) == NOTHING


def test_zip_bomb_is_413(client: TestClient, settings: CollectorSettings) -> None:
    bomb = gzip.compress(b'{"events": [' + b" " * (4 * 2**20) + b"]}", compresslevel=9)
    assert len(bomb) < settings.max_batch_bytes
    resp = post(client, bomb, **AUTH, **{"Content-Encoding": "gzip"})
    assert resp.status_code == 413
    assert "decompressed" in resp.json()["detail"]


@pytest.mark.parametrize(
    "content",
    [b"definitely not gzip", gzip.compress(ev.body(ev.mixed(4)))[:-12], gzip.compress(b"{}") + b"junk"],
    ids=["garbage", "truncated", "trailing"],
)
def test_bad_gzip_is_400(client: TestClient, settings: CollectorSettings, content: bytes) -> None:
    resp = post(client, content, **AUTH, **{"Content-Encoding": "gzip"})
    assert resp.status_code == 400
    assert stored(settings) == NOTHING


def test_unsupported_media_is_415(client: TestClient) -> None:
    body = ev.body(ev.mixed(4))
    assert post(client, body, **AUTH, **{"Content-Encoding": "br"}).status_code == 415
    resp = client.post("/v1/ingest", content=body, headers={**AUTH, "Content-Type": "text/plain"})
    assert resp.status_code == 415


def test_key_conflict_is_409(client: TestClient) -> None:
    assert post(client, ev.body(ev.mixed(4)), **AUTH, **{"Idempotency-Key": "k"}).status_code == 202
    assert post(client, ev.body(ev.mixed(5)), **AUTH, **{"Idempotency-Key": "k"}).status_code == 409


def test_metrics_and_health(client: TestClient) -> None:
    post(client, ev.body(ev.mixed(8)), **AUTH)
    assert client.get("/health").json() == {"status": "ok"}
    text = client.get("/metrics").text
    assert 'kvpilot_collector_ingest_events_total{type="request"} 2.0' in text
    assert 'kvpilot_collector_ingest_batches_total{result="accepted"} 1.0' in text
    assert "kvpilot_collector_ingest_batch_seconds_count 1.0" in text


def test_unmigrated_database_refuses_to_start(tmp_path) -> None:
    settings = CollectorSettings(db_url=f"sqlite:///{tmp_path / 'new.db'}", scrape_enabled=False)
    with pytest.raises(Exception, match="kvpilot db upgrade"), TestClient(create_app(settings)):
        pass


def test_openapi_documents_the_batch_schema(settings: CollectorSettings) -> None:
    with TestClient(create_app(settings.model_copy(update={"public_docs": True}))) as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/ingest"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/EventBatch"}
    assert {"RequestEvent", "StepEvent", "AllocEvent", "SampleEvent"} <= set(schema["components"]["schemas"])
    json.dumps(schema)


def test_a_retry_whose_key_is_stored_is_answered_without_parsing(
    client: TestClient, settings: CollectorSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collector import ingest

    body = ev.body(ev.mixed(8))
    assert post(client, body, **AUTH, **{"Idempotency-Key": "r-1"}).status_code == 202
    assert post(
        client, gzip.compress(body), **AUTH, **{"Idempotency-Key": "r-2", "Content-Encoding": "gzip"}
    ).is_success

    def no_parsing(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a stored batch was parsed again")

    monkeypatch.setattr(ingest, "parse_batch", no_parsing)
    again = post(client, body, **AUTH, **{"Idempotency-Key": "r-1"})
    assert again.status_code == 200 and again.json()["duplicate"] is True
    zipped = post(client, gzip.compress(body), **AUTH, **{"Idempotency-Key": "r-2", "Content-Encoding": "gzip"})
    assert zipped.status_code == 200 and zipped.json()["duplicate"] is True
    assert post(client, ev.body(ev.mixed(9)), **AUTH, **{"Idempotency-Key": "r-1"}).status_code == 409
    assert stored(settings)["ingest_batches"] == 2
