"""Named identities: the tokens file and its CLI, roles through the real app, reloads, adoption of the
fingerprints older versions stored, and the admin's reassignment."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, insert, select
from typer.testing import CliRunner

from collector import tokens
from collector.db import make_engine
from collector.errors import CollectorError
from collector.identities import IdentityStore
from collector.schema import InstanceOwner
from collector.server import check_bind_safety, create_app
from collector.settings import CollectorSettings
from kvpilot.cli import app as cli
from tests.collector import evfactory as ev

JSON = {"Content-Type": "application/json"}


def bearer(secret: str) -> dict[str, str]:
    return {**JSON, "Authorization": f"Bearer {secret}"}


@pytest.fixture
def file(tmp_path: Path) -> Path:
    return tmp_path / "tokens.json"


@pytest.fixture
def db(sqlite_url: str) -> Iterator[Engine]:
    engine = make_engine(sqlite_url)
    yield engine
    engine.dispose()


def client(sqlite_url: str, **kw: object) -> TestClient:
    settings = CollectorSettings(
        db_url=sqlite_url,
        scrape_enabled=False,
        scrape_allow_nets="127.0.0.0/8",
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
        **kw,
    )
    return TestClient(create_app(settings))


def who(store: IdentityStore, secret: str) -> str | None:
    """The name a secret authenticates as; None if it is refused."""
    identity = store.authenticate(secret)
    return None if identity is None else identity.name


def owners(db: Engine) -> dict[str, str]:
    with db.connect() as conn:
        return dict(conn.execute(select(InstanceOwner.instance, InstanceOwner.owner)).all())


# --- the file --------------------------------------------------------------------------------------------


def test_the_file_keeps_hashes_never_secrets(file: Path) -> None:
    secret, entry = tokens.add(file, "engine-a", ("ingest",))
    rotated, _ = tokens.rotate(file, "engine-a")
    text = file.read_text()
    assert secret not in text and rotated not in text and tokens.hash_secret(secret) in text
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert tokens.load(file).identities["engine-a"].secrets[0].id == entry.id
    with pytest.raises(tokens.TokensFileError, match="exists"):
        tokens.add(file, "engine-a", ("ingest",))
    with pytest.raises(tokens.TokensFileError, match="no secret 'nope'"):
        tokens.revoke(file, "engine-a", secret_id="nope")
    assert tokens.revoke(file, "engine-a", secret_id=entry.id) == 1
    assert len(tokens.load(file).identities["engine-a"].secrets) == 1


def test_a_broken_file_is_refused_at_start_and_ignored_on_reload(file: Path, sqlite_url: str) -> None:
    secret, _ = tokens.add(file, "engine-a", ("ingest",))
    registry = CollectorRegistry()
    store = IdentityStore(tokens_file=file, registry=registry)
    assert who(store, secret) == "engine-a"
    file.write_text('{"version": 1, "identities": {"bad:name": {"roles": ["ingest"]}}}')
    for _ in range(3):  # the last good file holds; the broken one is reported once, not per request
        assert who(store, secret) == "engine-a"
    assert registry.get_sample_value("kvpilot_collector_tokens_reloads_total", {"result": "failed"}) == 1.0
    file.write_text('{"version": 1, "identities": {}}')  # fixed (here: every identity removed)
    assert store.authenticate(secret) is None
    assert registry.get_sample_value("kvpilot_collector_tokens_reloads_total", {"result": "ok"}) == 2.0
    file.write_text('{"version": 1, "identities": {"bad:name": {"roles": ["ingest"]}}}')
    with pytest.raises(tokens.TokensFileError, match=r"identities\.bad:name"):
        IdentityStore(tokens_file=file)
    with pytest.raises(CollectorError, match="tokens file"):
        check_bind_safety(CollectorSettings(db_url=sqlite_url, tokens_file=file))


def test_environment_tokens_join_the_file_and_secrets_expire(file: Path) -> None:
    now = [1000.0]
    secret, _ = tokens.add(file, "ingest", ("ingest",))
    store = IdentityStore(ingest_token="env-secret", admin_token="adm", tokens_file=file, clock=lambda: now[0])
    assert who(store, "env-secret") == "ingest"
    assert who(store, secret) == "ingest"
    admin = store.authenticate("adm")
    assert admin is not None and admin.name == "admin" and admin.may("admin") and admin.may("read")
    assert store.authenticate("nope") is None
    tokens.rotate(file, "ingest", old_expire_in_s=60)
    now[0] = 10.0**12  # far past every expiry
    assert store.authenticate(secret) is None and store.authenticate("env-secret") is not None


def test_roles_through_the_app(file: Path, sqlite_url: str) -> None:
    pusher, _ = tokens.add(file, "engine-a", ("ingest",))
    reader, _ = tokens.add(file, "grafana", ("read",))
    admin, _ = tokens.add(file, "ops", ("admin",))
    body = ev.body([ev.step(0, instance="gpu-0")])
    target = {"url": "http://127.0.0.1:9400/metrics", "instance": "gpu-0"}
    with client(sqlite_url, tokens_file=file) as c:
        assert c.post("/v1/ingest", content=body).status_code == 401  # a tokens file closes pushes
        assert c.post("/v1/ingest", content=body, headers=bearer(reader)).status_code == 403
        assert c.post("/v1/ingest", content=body, headers=bearer(pusher)).status_code == 202
        assert c.get("/v1/targets", headers=bearer(reader)).status_code == 200
        assert c.get("/v1/targets").status_code == 401
        refused = c.post("/v1/targets", json=target, headers=bearer(pusher))
        assert refused.status_code == 403 and "'engine-a' (roles: ingest)" in refused.json()["detail"]
        paired = c.post("/v1/targets", json=target, headers=bearer(admin))  # an admin pairs any pusher's instance
        assert paired.status_code == 201, paired.text
        tokens.revoke(file, "engine-a")  # every secret gone: pushes stay closed, never open
        assert c.post("/v1/ingest", content=body, headers=bearer(pusher)).status_code == 403
        assert c.post("/v1/ingest", content=body).status_code == 401


def test_bind_safety_accepts_a_tokens_file(file: Path, sqlite_url: str) -> None:
    tokens.add(file, "engine-a", ("ingest",))
    check_bind_safety(CollectorSettings(db_url=sqlite_url, host="0.0.0.0", tokens_file=file))
    with pytest.raises(CollectorError, match="KVPILOT_TOKENS_FILE"):
        check_bind_safety(CollectorSettings(db_url=sqlite_url, host="0.0.0.0"))


# --- ownership: adoption and reassignment ------------------------------------------------------------------


def test_instances_of_a_known_tokens_fingerprint_are_adopted_at_startup(sqlite_url: str, db: Engine) -> None:
    """What an older collector stored for KVPILOT_INGEST_TOKEN=old: its fingerprint. After the upgrade the
    identity `ingest` owns those instances, so a later token value pushes into them (once 409 forever)."""
    fingerprint = tokens.legacy_owner(tokens.hash_secret("old"))
    with db.begin() as conn:
        conn.execute(insert(InstanceOwner), [{"instance": "gpu-0", "owner": fingerprint, "claimed_at": 1.0}])
    with client(sqlite_url, ingest_token="old") as c:
        assert owners(db) == {"gpu-0": "ingest"}
    with client(sqlite_url, ingest_token="new") as c:
        pushed = c.post("/v1/ingest", content=ev.body([ev.step(0, instance="gpu-0")]), headers=bearer("new"))
        assert pushed.status_code == 202, pushed.text


def test_owners_and_reassign_through_the_cli(sqlite_url: str, db: Engine, file: Path) -> None:
    stale = tokens.legacy_owner(tokens.hash_secret("lost"))
    with db.begin() as conn:
        rows = [{"instance": f"gpu-{i}", "owner": stale, "claimed_at": 1.0} for i in range(3)]
        conn.execute(insert(InstanceOwner), [*rows, {"instance": "t", "owner": "target:1", "claimed_at": 1.0}])
    runner = CliRunner()
    listed = runner.invoke(cli, ["collector", "tokens", "owners", "--db-url", sqlite_url])
    assert listed.exit_code == 0 and f"3  {stale}" in listed.output
    reassign = ["collector", "tokens", "reassign", "--from", stale, "--to", "engine-a", "--db-url", sqlite_url]
    moved = runner.invoke(cli, [*reassign, "--instance", "gpu-0"])
    assert moved.exit_code == 0 and "1 instance(s)" in moved.output
    rest = runner.invoke(cli, reassign)
    assert rest.exit_code == 0 and "2 instance(s)" in rest.output
    assert set(owners(db).values()) == {"engine-a", "target:1"}
    for args, message in (
        (["--from", stale, "--to", "engine-a"], "owns no instance"),
        (["--from", "target:1", "--to", "engine-a"], "delete the target"),
        (["--from", "engine-a", "--to", "bad:name"], "not an identity name"),
    ):
        failed = runner.invoke(cli, ["collector", "tokens", "reassign", *args, "--db-url", sqlite_url])
        assert failed.exit_code == 1 and message in failed.output, failed.output
    secret, _ = tokens.add(file, "engine-a", ("ingest",))
    with client(sqlite_url, tokens_file=file) as c:
        pushed = c.post("/v1/ingest", content=ev.body([ev.step(0, instance="gpu-2")]), headers=bearer(secret))
        assert pushed.status_code == 202, pushed.text


def test_tokens_cli_prints_the_secret_once_and_lists_none(file: Path) -> None:
    runner = CliRunner()
    added = runner.invoke(cli, ["collector", "tokens", "add", "engine-a", "--role", "ingest", "--file", str(file)])
    assert added.exit_code == 0, added.output
    secret = added.stdout.strip().splitlines()[-1]
    assert secret.startswith("kvp_") and len(secret) > 40
    listed = runner.invoke(cli, ["collector", "tokens", "list", "--file", str(file)])
    assert listed.exit_code == 0 and "engine-a  roles=ingest" in listed.output
    assert secret not in listed.output and tokens.hash_secret(secret) not in listed.output
    data = json.loads(file.read_text())
    assert list(data["identities"]) == ["engine-a"]
    bad = runner.invoke(cli, ["collector", "tokens", "add", "x", "--role", "root", "--file", str(file)])
    assert bad.exit_code == 2 and "--role" in bad.output
    missing = runner.invoke(cli, ["collector", "tokens", "rotate", "nobody", "--file", str(file)])
    assert missing.exit_code == 1 and "no identity 'nobody'" in missing.output
