"""/health reports whether the database takes writes and has room, not only whether it answers.

Before, /health said 200 while every push got 503 (a full disk, a read-only database). Faults are real:
SQLite opened read-only, SQLite's own page limit (`PRAGMA max_page_count`) standing in for a full disk
on every connection the collector opens, a PostgreSQL session that is read-only (as on a standby).
"""

from __future__ import annotations

import sqlite3
import time
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, text

from collector.db import is_sqlite, make_engine
from collector.server import create_app
from collector.settings import CollectorSettings
from collector.storage_check import storage_problem
from tests.collector import evfactory as ev

TOKEN = "lows-health"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
Usage = namedtuple("Usage", "total used free")


def _settings(url: str) -> CollectorSettings:
    return CollectorSettings(db_url=url, ingest_token=TOKEN, scrape_enabled=False)


def _push(client: TestClient, events: int = 1) -> int:
    now = time.time()
    body = ev.body([ev.step(i, ts=now) for i in range(events)])
    return client.post("/v1/ingest", content=body, headers=HEADERS).status_code


@pytest.fixture
def on_every_connect() -> Iterator[list[str]]:
    """SQL run on every new DBAPI connection of any engine, while the test runs (a fault for all of them)."""
    statements: list[str] = []

    def apply(dbapi_conn, _record) -> None:
        cursor = dbapi_conn.cursor()
        for statement in statements:
            cursor.execute(statement)
        cursor.close()
        if not isinstance(dbapi_conn, sqlite3.Connection):
            dbapi_conn.commit()  # psycopg: the SET is session-wide once committed

    event.listen(Engine, "connect", apply)
    yield statements
    event.remove(Engine, "connect", apply)


def test_a_healthy_database_passes(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert storage_problem(engine, min_free_bytes=64 * 2**20) is None
    finally:
        engine.dispose()


def test_a_read_only_sqlite_file_is_503_like_the_pushes(sqlite_url: str) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:  # the WAL's shared memory must exist for a read-only open
        conn.execute("PRAGMA journal_mode=WAL")
    with TestClient(create_app(_settings(f"sqlite:///file:{path}?mode=ro&uri=true"))) as client:
        assert _push(client) == 503
        health = client.get("/health")
    assert health.status_code == 503 and health.json()["detail"] == "the database refuses writes"


def test_a_full_sqlite_database_is_503_like_the_pushes(sqlite_url: str, on_every_connect: list[str]) -> None:
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    on_every_connect.append(f"PRAGMA max_page_count = {pages}")
    with TestClient(create_app(_settings(sqlite_url))) as client:
        assert _push(client, events=500) == 503  # database or disk is full: new pages are needed
        health = client.get("/health")
    assert health.status_code == 503 and "MiB left for the database" in health.json()["detail"]


def test_little_room_on_the_filesystem_is_storage_full(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        almost_full = lambda _path: Usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20)  # noqa: E731
        problem = storage_problem(engine, min_free_bytes=64 * 2**20, disk_usage=almost_full)
        assert problem is not None and problem[0] == "storage_full" and problem[1].startswith("1 MiB left")
        assert storage_problem(engine, min_free_bytes=0, disk_usage=almost_full) is None
    finally:
        engine.dispose()


def test_a_writer_holding_the_lock_is_busy_not_read_only(sqlite_url: str, tmp_path: Path) -> None:
    engine = make_engine(sqlite_url)
    writer = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        assert storage_problem(engine, min_free_bytes=0, lock_wait_s=0.2) is None
        assert time.monotonic() - started < 5
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        engine.dispose()


@pytest.mark.postgres
def test_a_read_only_postgresql_session_is_503_like_the_pushes(pg_url: str, on_every_connect: list[str]) -> None:
    on_every_connect.append("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    with TestClient(create_app(_settings(pg_url))) as client:
        assert _push(client) in (500, 503)
        health = client.get("/health")
    assert health.status_code == 503 and health.json()["detail"] == "the database refuses writes"


def test_the_probe_writes_nothing(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            before = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        assert storage_problem(engine, min_free_bytes=0) is None
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == before
        assert is_sqlite(db_url) or before
    finally:
        engine.dispose()
