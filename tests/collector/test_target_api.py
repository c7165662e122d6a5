"""The target API and the collector's scopes through the real ASGI app (SQLite): who may administer
targets, which URLs a target may reach (SSRF), who owns an instance, what is public, where it may bind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collector import tokens
from collector.errors import CollectorError
from collector.server import check_bind_safety, create_app
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

TOKEN = "s3cret"
ADMIN_TOKEN = "adm1n"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LOOPBACK_ALLOWED = "127.0.0.0/8,::1/128"


@pytest.fixture
def settings(sqlite_url: str) -> CollectorSettings:
    return CollectorSettings(
        db_url=sqlite_url,
        ingest_token=TOKEN,
        admin_token=ADMIN_TOKEN,
        scrape_enabled=False,
        scrape_allow_nets=LOOPBACK_ALLOWED,
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def app_client(settings: CollectorSettings, **update: object) -> TestClient:
    return TestClient(create_app(CollectorSettings.model_validate({**settings.model_dump(), **update})))


def test_target_crud(client: TestClient) -> None:
    created = client.post("/v1/targets", json={"url": "http://127.0.0.1:9400/metrics", "job": "dcgm"}, headers=ADMIN)
    assert created.status_code == 201, created.text
    target = created.json()
    assert target["instance"] == "127.0.0.1:9400" and target["interval_s"] == 15.0 and target["up"] is None
    dup = client.post("/v1/targets", json={"url": "http://127.0.0.1:9400/metrics"}, headers=ADMIN)
    assert dup.status_code == 409 and dup.json()["errors"][0]["loc"] == "url"
    assert client.post("/v1/targets", json={"url": "ftp://x/metrics"}, headers=ADMIN).status_code == 422
    # Listing takes either token.
    assert [t["id"] for t in client.get("/v1/targets", headers=AUTH).json()] == [target["id"]]
    assert client.get(f"/v1/targets/{target['id']}", headers=ADMIN).json()["job"] == "dcgm"
    assert client.delete(f"/v1/targets/{target['id']}", headers=ADMIN).status_code == 204
    assert client.delete(f"/v1/targets/{target['id']}", headers=ADMIN).status_code == 404
    assert client.get("/v1/targets/99", headers=AUTH).status_code == 404


def test_target_labels_and_sample_limit(client: TestClient) -> None:
    body = {"url": "http://127.0.0.1:9400/metrics", "labels": {"node": "gpu-1"}, "sample_limit": 500}
    created = client.post("/v1/targets", json=body, headers=ADMIN)
    assert created.status_code == 201, created.text
    assert created.json()["labels"] == {"node": "gpu-1"} and created.json()["sample_limit"] == 500
    listed = client.get("/v1/targets", headers=AUTH).json()
    assert listed[0]["labels"] == {"node": "gpu-1"}
    for bad in ({"__meta": "x"}, {"instance": "x"}, {"node": "x" * 300}, {str(i): "v" for i in range(40)}):
        refused = client.post("/v1/targets", json={"url": "http://127.0.0.1:9401/m", "labels": bad}, headers=ADMIN)
        assert refused.status_code == 422, bad
        assert "labels" in refused.text
    too_many = {"url": "http://127.0.0.1:9401/m", "sample_limit": 0}
    assert client.post("/v1/targets", json=too_many, headers=ADMIN).status_code == 422


# --- scopes --------------------------------------------------------------------------------------------


def test_the_ingest_token_cannot_administer_targets(client: TestClient) -> None:
    body = {"url": "http://127.0.0.1:9400/metrics"}
    refused = client.post("/v1/targets", json=body, headers=AUTH)
    assert refused.status_code == 403 and "KVPILOT_ADMIN_TOKEN" in refused.json()["detail"]
    assert client.post("/v1/targets", json=body).status_code == 401
    target = client.post("/v1/targets", json=body, headers=ADMIN).json()
    assert client.delete(f"/v1/targets/{target['id']}", headers=AUTH).status_code == 403
    assert client.get("/v1/targets").status_code == 401
    # ...and the admin token cannot push.
    assert client.post("/v1/ingest", content=ev.body(ev.mixed(4)), headers=ADMIN).status_code == 403


def test_without_an_admin_token_administration_is_refused_with_the_way_to_enable_it(
    settings: CollectorSettings,
) -> None:
    body = {"url": "http://127.0.0.1:9400/metrics"}
    for token in (TOKEN, None):  # with or without an ingest token: nobody may, not even on loopback
        with app_client(settings, admin_token=None, ingest_token=token) as c:
            refused = c.post("/v1/targets", json=body, headers=AUTH if token else {})
            assert refused.status_code == 403
            assert "KVPILOT_ADMIN_TOKEN" in refused.json()["detail"] and "KVPILOT_DEV_MODE" in refused.json()["detail"]
            assert c.get("/v1/targets", headers=AUTH if token else {}).status_code == 200
    # Dev mode on loopback: the ingest token (if any) is enough.
    with app_client(settings, admin_token=None, dev_mode=True) as c:
        assert c.post("/v1/targets", json=body, headers=AUTH).status_code == 201
        assert c.post("/v1/targets", json={"url": "http://127.0.0.1:9401/m"}).status_code == 401
    # Dev mode off loopback does not apply (and `check_bind_safety` refuses to start so).
    with app_client(settings, admin_token=None, dev_mode=True, host="0.0.0.0") as c:
        assert c.post("/v1/targets", json={"url": "http://127.0.0.1:9402/m"}, headers=AUTH).status_code == 403


def test_docs_are_off_and_metrics_public_by_default_when_a_token_is_set(settings: CollectorSettings) -> None:
    with app_client(settings) as c:
        assert c.get("/openapi.json").status_code == 404 and c.get("/docs").status_code == 404
        assert c.get("/metrics").status_code == 200
        assert c.get("/health").status_code == 200
    with app_client(settings, public_metrics=False, public_docs=True) as c:
        assert c.get("/metrics").status_code == 401
        assert (
            c.get("/metrics", headers=AUTH).status_code == 200 and c.get("/metrics", headers=ADMIN).status_code == 200
        )
        assert c.get("/openapi.json").status_code == 200 and c.get("/docs").status_code == 200
        assert c.get("/health").status_code == 200
    with app_client(settings, ingest_token=None, admin_token=None) as c:  # a loopback development collector
        assert c.get("/openapi.json").status_code == 200


def test_bind_safety(sqlite_url: str) -> None:
    check_bind_safety(CollectorSettings(db_url=sqlite_url, host="127.0.0.1"))
    check_bind_safety(CollectorSettings(db_url=sqlite_url, host="127.0.0.2", dev_mode=True))
    check_bind_safety(CollectorSettings(db_url=sqlite_url, host="0.0.0.0", ingest_token=TOKEN))
    for bad in ({"host": "0.0.0.0"}, {"host": "::", "admin_token": ADMIN_TOKEN}, {"host": "10.0.0.5"}):
        with pytest.raises(CollectorError, match="KVPILOT_INGEST_TOKEN"):
            check_bind_safety(CollectorSettings(db_url=sqlite_url, **bad))
    with pytest.raises(CollectorError, match="KVPILOT_DEV_MODE"):
        check_bind_safety(CollectorSettings(db_url=sqlite_url, host="0.0.0.0", ingest_token=TOKEN, dev_mode=True))
    with pytest.raises(ValueError, match="must differ"):
        CollectorSettings(ingest_token="same", admin_token="same")


# --- SSRF at creation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://127.0.0.1:9400/metrics", "loopback"),
        ("http://localhost:9400/metrics", "loopback"),
        ("http://[::1]:9400/metrics", "loopback"),
        ("http://[::ffff:127.0.0.1]:9400/metrics", "loopback"),
        ("http://169.254.10.1/metrics", "link-local"),
        ("http://[fe80::1]/metrics", "link-local"),
        ("http://0.0.0.0:9400/metrics", "unspecified"),
        ("http://224.0.0.1/metrics", "multicast"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[fd00:ec2::254]/latest/meta-data/", "metadata"),
        ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
    ],
)
def test_targets_that_reach_internal_addresses_are_refused(settings: CollectorSettings, url: str, kind: str) -> None:
    with app_client(settings, scrape_allow_nets=()) as c:
        refused = c.post("/v1/targets", json={"url": url}, headers=ADMIN)
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["loc"] == "url" and kind in refused.json()["detail"]
        assert c.get("/v1/targets", headers=ADMIN).json() == []
    # The allow-list admits loopback and link-local, never a metadata endpoint.
    with app_client(settings, scrape_allow_nets=(*settings.scrape_allow_nets, "169.254.0.0/16", "fe80::/10")) as c:
        expected = 422 if kind == "metadata" else (422 if kind in ("unspecified", "multicast") else 201)
        assert c.post("/v1/targets", json={"url": url}, headers=ADMIN).status_code == expected


def test_a_private_network_target_needs_no_allow_list(settings: CollectorSettings) -> None:
    with app_client(settings, scrape_allow_nets=()) as c:
        assert c.post("/v1/targets", json={"url": "http://10.1.2.3:9400/metrics"}, headers=ADMIN).status_code == 201


# --- instance ownership at creation ---------------------------------------------------------------------


def test_a_target_may_not_take_an_instance_owned_by_another(
    client: TestClient, settings: CollectorSettings, tmp_path: Path
) -> None:
    first = client.post("/v1/targets", json={"url": "http://127.0.0.1:9400/m", "instance": "gpu-0"}, headers=ADMIN)
    assert first.status_code == 201
    second = client.post("/v1/targets", json={"url": "http://127.0.0.1:9401/m", "instance": "gpu-0"}, headers=ADMIN)
    assert second.status_code == 409 and second.json()["errors"][0]["loc"] == "instance"
    assert "already scraped by target" in second.json()["detail"]
    # An instance pushed under the collector's ingest token may also be scraped (vLLM: spans and /metrics).
    body = ev.body([ev.step(0, instance="vllm-0")])
    pushed = client.post("/v1/ingest", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert pushed.status_code == 202
    paired = client.post("/v1/targets", json={"url": "http://127.0.0.1:9402/m", "instance": "vllm-0"}, headers=ADMIN)
    assert paired.status_code == 201, paired.text
    again = client.post("/v1/targets", json={"url": "http://127.0.0.1:9403/m", "instance": "vllm-0"}, headers=ADMIN)
    assert again.status_code == 409
    # ...and one pushed by an identity the collector no longer knows (revoked) may not.
    path = tmp_path / "tokens.json"
    gone, _ = tokens.add(path, "gone", ("ingest",))
    with app_client(settings, tokens_file=path) as c:
        body = ev.body([ev.step(0, instance="old")])
        gone_auth = {"Authorization": f"Bearer {gone}", "Content-Type": "application/json"}
        assert c.post("/v1/ingest", content=body, headers=gone_auth).status_code == 202
        tokens.revoke(path, "gone")
        refused = c.post("/v1/targets", json={"url": "http://127.0.0.1:9404/m", "instance": "old"}, headers=ADMIN)
        assert refused.status_code == 409 and "another identity (gone)" in refused.json()["detail"]
    # Deleting a target frees its instance.
    assert client.delete(f"/v1/targets/{first.json()['id']}", headers=ADMIN).status_code == 204
    retaken = client.post("/v1/targets", json={"url": "http://127.0.0.1:9401/m", "instance": "gpu-0"}, headers=ADMIN)
    assert retaken.status_code == 201
