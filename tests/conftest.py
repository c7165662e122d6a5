"""Shared database fixtures: every storage test runs on SQLite and on PostgreSQL.

PostgreSQL comes from KVPILOT_TEST_PG_URL (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test).
Unset: PostgreSQL cases are skipped with the reason. KVPILOT_REQUIRE_PG=1 (CI): an unreachable server
fails those cases instead. Each test session works in its own fresh schema, dropped at the end, so
parallel sessions on one server do not collide.

Fixtures:
- `db_url` (parametrized sqlite/postgres): a URL of a database migrated to head, empty for each test.
- `db_engine`: an Engine on `db_url`.
- `sqlite_url`: SQLite only, for tests that need a file (server subprocesses, kill -9).
- `vllm_peer` (session): one real vLLM started by `kvpilot vllm serve`, shipping to a collector subprocess
  (tests/vllm/peer.py); tests that use it carry the `vllm` marker.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from collector.db import make_engine, upgrade

if TYPE_CHECKING:
    from tests.vllm.peer import VllmPeer

PG_ENV = "KVPILOT_TEST_PG_URL"


@pytest.fixture(autouse=True)
def _keep_main_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamlit's AppTest leaves the dashboard script as `sys.modules["__main__"]`; a process spawned later
    (the vLLM replay client) would run that script again on start and die. Each test gets back the
    `__main__` it started with."""
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])


def _require_pg() -> bool:
    return os.environ.get("KVPILOT_REQUIRE_PG") == "1"


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("db-template") / "template.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path


@pytest.fixture
def sqlite_url(_sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh migrated SQLite file (a copy of a session template: migrating per test is slow)."""
    path = tmp_path / "kvpilot.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def _pg_schema_url() -> Iterator[str]:
    base = os.environ.get(PG_ENV)
    if not base:
        if _require_pg():
            pytest.fail(f"KVPILOT_REQUIRE_PG=1 but {PG_ENV} is not set")
        pytest.skip(f"PostgreSQL tests need {PG_ENV} (e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test)")
    schema = f"kvp_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:
        admin.dispose()
        message = f"PostgreSQL at {make_url(base).render_as_string(hide_password=True)} unreachable: {exc}"
        if _require_pg():
            pytest.fail(message)
        pytest.skip(message)
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    url_str = url.render_as_string(hide_password=False)
    try:
        upgrade(url_str)
        yield url_str
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def _truncate_all(url: str) -> None:
    """Empty every table of the session schema (whoever's revision created it), keep the version."""
    engine = create_engine(url)
    with engine.begin() as conn:
        names = (
            conn.execute(
                text(
                    "SELECT tablename FROM pg_tables"
                    " WHERE schemaname = current_schema() AND tablename <> 'alembic_version'"
                )
            )
            .scalars()
            .all()
        )
        if names:
            conn.execute(text(f"TRUNCATE {', '.join(chr(34) + n + chr(34) for n in names)} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture
def pg_url(_pg_schema_url: str) -> Iterator[str]:
    _truncate_all(_pg_schema_url)
    yield _pg_schema_url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def vllm_peer(tmp_path_factory: pytest.TempPathFactory, _sqlite_template: Path) -> Iterator[VllmPeer]:
    from tests.vllm.peer import start_peer, stop_peer

    peer = start_peer(tmp_path_factory.mktemp("vllm"), _sqlite_template)
    yield peer
    code = stop_peer(peer)
    assert code == 0, f"kvpilot vllm serve exited with {code} after SIGTERM {peer.where()}"
    assert b", 0 unparsable" in peer.kvpilot_log.read_bytes(), f"vLLM's log format changed? {peer.where()}"
