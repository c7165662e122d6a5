"""Instance ownership and cardinality bounds of pushes: through the ASGI app (SQLite) and at the data
layer on SQLite and PostgreSQL. A refused batch leaves nothing behind."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select

from collector import tokens
from collector.claims import (
    CardinalityError,
    CardinalityLimits,
    Claims,
    ClaimWindows,
    InstanceOwnedError,
    RateWindow,
)
from collector.db import make_engine
from collector.ingest import parse_batch, store_batch
from collector.schema import IngestBatch, Instance, InstanceOwner, Run, StepRow
from collector.server import create_app
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            m.__tablename__: conn.execute(select(func.count()).select_from(m.__table__)).scalar_one()
            for m in (IngestBatch, Instance, Run, InstanceOwner, StepRow)
        }


@pytest.fixture
def settings(sqlite_url: str) -> CollectorSettings:
    return CollectorSettings(
        db_url=sqlite_url, ingest_token=TOKEN, scrape_enabled=False, raw_retention_days=ev.REPLAY_RETENTION_DAYS
    )


def client_for(settings: CollectorSettings, **update: object) -> TestClient:
    return TestClient(create_app(CollectorSettings.model_validate({**settings.model_dump(), **update})))


@pytest.fixture
def sqlite_engine(settings: CollectorSettings) -> Iterator[Engine]:
    engine = make_engine(settings.db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with client_for(settings) as c:
        yield c


def steps(n: int, *, instances: int = 1, runs: int = 1, prefix: str = "gpu") -> bytes:
    events = [ev.step(i, instance=f"{prefix}-{i % instances}", run_id=f"run-{i % runs}") for i in range(n)]
    return ev.body(events)


def test_one_request_cannot_create_thousands_of_instances(client: TestClient, sqlite_engine: Engine) -> None:
    """Five such requests once made 100,000 instances and runs in 3.4 s."""
    before = counts(sqlite_engine)
    refused = client.post("/v1/ingest", content=steps(2000, instances=2000), headers=AUTH)
    assert refused.status_code == 422, refused.text
    assert refused.json()["errors"][0]["loc"] == "events[].instance"
    assert counts(sqlite_engine) == before
    metrics = client.get("/metrics").text
    assert 'kvpilot_collector_ingest_rejected_total{reason="too_many_instances"} 1.0' in metrics


def test_instances_per_identity_are_bounded(settings: CollectorSettings, sqlite_engine: Engine) -> None:
    with client_for(settings, max_instances_per_identity=10) as c:
        assert c.post("/v1/ingest", content=steps(10, instances=10), headers=AUTH).status_code == 202
        assert c.post("/v1/ingest", content=steps(10, instances=10), headers=AUTH).status_code == 202  # not new
        before = counts(sqlite_engine)
        refused = c.post("/v1/ingest", content=steps(1, prefix="new"), headers=AUTH)
        assert refused.status_code == 422 and "KVPILOT_MAX_INSTANCES_PER_IDENTITY" in refused.json()["detail"]
        assert counts(sqlite_engine) == before


def test_new_runs_per_instance_and_minute_are_bounded(
    settings: CollectorSettings, sqlite_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with client_for(settings, max_new_runs_per_minute=3) as c:
        assert c.post("/v1/ingest", content=steps(3, runs=3), headers=AUTH).status_code == 202
        assert c.post("/v1/ingest", content=steps(6, runs=3), headers=AUTH).status_code == 202  # the same runs
        before = counts(sqlite_engine)
        with caplog.at_level(logging.WARNING, logger="kvpilot.collector"):
            for _ in range(3):
                later = c.post("/v1/ingest", content=ev.body([ev.step(0, instance="gpu-0", run_id="r4")]), headers=AUTH)
                assert later.status_code == 429 and 1 <= int(later.headers["retry-after"]) <= 60
                assert later.json()["errors"][0]["loc"] == "events[].run_id"
        assert counts(sqlite_engine) == before
        too_many = c.post("/v1/ingest", content=steps(4, runs=4, prefix="other"), headers=AUTH)
        assert too_many.status_code == 422  # one batch past the bound: waiting cannot help
        # Another instance has a window of its own.
        assert c.post("/v1/ingest", content=steps(3, runs=3, prefix="other"), headers=AUTH).status_code == 202
        metrics = c.get("/metrics").text
    assert 'kvpilot_collector_ingest_rejected_total{reason="new_runs_rate"} 4.0' in metrics
    lines = [r.getMessage() for r in caplog.records if "new_runs_rate" in r.getMessage()]
    assert len(lines) == 1  # logged once, not once per refusal


def test_an_instance_belongs_to_the_identity_that_pushed_it_first(
    settings: CollectorSettings, sqlite_engine: Engine, tmp_path: Path
) -> None:
    path = tmp_path / "tokens.json"
    alice, _ = tokens.add(path, "alice", ("ingest",))
    bob, _ = tokens.add(path, "bob", ("ingest",))
    with client_for(settings, tokens_file=path) as c:
        assert (
            c.post("/v1/ingest", content=steps(4), headers={**AUTH, "Authorization": f"Bearer {alice}"}).status_code
            == 202
        )
        before = counts(sqlite_engine)
        refused = c.post("/v1/ingest", content=steps(4), headers={**AUTH, "Authorization": f"Bearer {bob}"})
        assert refused.status_code == 409 and refused.json()["errors"][0]["loc"] == "events[].instance"
        assert "another identity" in refused.json()["detail"] and "tokens reassign" in refused.json()["detail"]
        assert counts(sqlite_engine) == before


def test_rotating_the_environment_token_keeps_the_instances(settings: CollectorSettings) -> None:
    """KVPILOT_INGEST_TOKEN is the identity `ingest` whatever its value: a new value once meant 409 forever."""
    with client_for(settings, ingest_token=None) as c:  # no token yet (loopback development)
        assert c.post("/v1/ingest", content=steps(4), headers=AUTH).status_code == 202
    for token in (TOKEN, "rotated"):
        with client_for(settings, ingest_token=token) as c:
            pushed = c.post(
                "/v1/ingest", content=steps(8, runs=2), headers={**AUTH, "Authorization": f"Bearer {token}"}
            )
            assert pushed.status_code == 202, pushed.text


def test_new_runs_are_bounded_per_identity_too(settings: CollectorSettings, sqlite_engine: Engine) -> None:
    """10,000 new runs in 1 s across 100 instances once passed: each instance stayed under its own bound."""
    with client_for(settings, max_new_runs_per_minute=100, max_new_runs_per_minute_per_identity=50) as c:
        assert c.post("/v1/ingest", content=steps(40, instances=10, runs=40), headers=AUTH).status_code == 202
        before = counts(sqlite_engine)
        later = c.post("/v1/ingest", content=steps(20, instances=10, runs=20, prefix="more"), headers=AUTH)
        assert later.status_code == 429 and later.json()["errors"][0]["loc"] == "events[].run_id"
        assert "KVPILOT_MAX_NEW_RUNS_PER_MINUTE_PER_IDENTITY" in later.json()["detail"]
        at_once = c.post("/v1/ingest", content=steps(60, instances=20, runs=60, prefix="big"), headers=AUTH)
        assert at_once.status_code == 422  # one batch past the bound: waiting cannot help
        assert counts(sqlite_engine) == before


def test_lowercase_bearer_scheme_is_accepted(client: TestClient) -> None:
    """RFC 7235 2.1: the auth scheme is case-insensitive."""
    for scheme in ("bearer", "BEARER", "Bearer"):
        pushed = client.post("/v1/ingest", content=steps(1), headers={**AUTH, "Authorization": f"{scheme} {TOKEN}"})
        assert pushed.status_code == 202, (scheme, pushed.text)
    wrong = client.post("/v1/ingest", content=steps(1), headers={**AUTH, "Authorization": "bearer nope"})
    assert wrong.status_code == 403


# --- the data layer, on both backends -------------------------------------------------------------------


def _store(engine: Engine, claims: Claims, body: bytes, key: str) -> None:
    store_batch(engine, parse_batch(body, max_events=10_000), idempotency_key=key, content=body, claims=claims)


def test_claims_at_the_data_layer(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        windows = ClaimWindows(CardinalityLimits(max_instances=5, new_instances_per_minute=4, new_runs_per_minute=1))
        alice, bob = Claims("alice", windows), Claims("bob", windows)
        _store(engine, alice, steps(8, instances=2, runs=2), "a1")
        with pytest.raises(InstanceOwnedError):
            _store(engine, bob, ev.body([ev.step(0, instance="gpu-1"), ev.step(1, instance="bob-0")]), "b1")
        with pytest.raises(CardinalityError) as rate:
            _store(engine, alice, steps(3, instances=3, prefix="x"), "a2")  # 2 + 3 new > 4 a minute
        assert rate.value.retry_after_s is not None and 0 < rate.value.retry_after_s <= 60
        _store(engine, bob, steps(2, instances=2, prefix="bob"), "b2")
        with pytest.raises(CardinalityError) as runs:
            _store(engine, alice, ev.body([ev.step(0, instance="gpu-0", run_id="run-9")]), "a3")
        assert runs.value.reason == "new_runs_rate"
        assert counts(engine) == {"ingest_batches": 2, "instances": 4, "runs": 4, "instance_owners": 4, "steps": 10}
        with engine.connect() as conn:
            owners = dict(conn.execute(select(InstanceOwner.instance, InstanceOwner.owner)).all())
        assert owners == {
            "gpu-0": alice.identity,
            "gpu-1": alice.identity,
            "bob-0": bob.identity,
            "bob-1": bob.identity,
        }
    finally:
        engine.dispose()


def test_rate_window_expires() -> None:
    now = [0.0]
    window = RateWindow(60.0, clock=lambda: now[0])
    window.add("k", 3)
    now[0] = 30.0
    window.add("k", 2)
    assert window.count("k") == 5
    assert window.retry_after("k", need=1, limit=5) == pytest.approx(30.0)  # when the first 3 expire
    assert window.retry_after("k", need=4, limit=5) == pytest.approx(60.0)  # all of them
    now[0] = 60.0
    assert window.count("k") == 2
    now[0] = 90.0
    assert window.count("k") == 0 and window.retry_after("k", need=1, limit=5) == 0.0
