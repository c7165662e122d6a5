"""The pool pings a connection only after it sat idle (`collector.db.ping_when_idle`), and replaces a dead one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from collector.db import PING_AFTER_IDLE_S, make_engine


def _counted(engine: Engine) -> list[int]:
    pings: list[int] = []
    ping = engine.dialect.do_ping

    def counting(dbapi_conn: object) -> bool:
        pings.append(1)
        return ping(dbapi_conn)

    engine.dialect.do_ping = counting  # type: ignore[method-assign]  # the instance's, for this engine only
    return pings


def _backend(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(url: str, pid: int) -> None:
    other = make_engine(url)
    try:
        with other.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        other.dispose()


@pytest.mark.postgres
def test_a_connection_back_moments_ago_is_not_pinged_and_an_idle_one_is(pg_url: str) -> None:
    engine = make_engine(pg_url, pool_size=1)
    pings = _counted(engine)
    try:
        first = _backend(engine)  # a new connection: nothing to ping
        for _ in range(5):
            assert _backend(engine) == first
        assert pings == []
        time.sleep(PING_AFTER_IDLE_S + 0.1)
        assert _backend(engine) == first and len(pings) == 1
    finally:
        engine.dispose()


@pytest.fixture
def killed(pg_url: str) -> Iterator[tuple[Engine, int]]:
    """A one-connection pool whose connection's backend was just terminated, and that backend's pid."""
    engine = make_engine(pg_url, pool_size=1)
    try:
        dead = _backend(engine)
        _terminate(pg_url, dead)
        yield engine, dead
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_an_idle_connection_that_died_is_replaced_before_it_is_used(killed: tuple[Engine, int]) -> None:
    engine, dead = killed
    time.sleep(PING_AFTER_IDLE_S + 0.1)
    assert _backend(engine) != dead  # the ping found it gone: a new connection, no error


@pytest.mark.postgres
def test_a_connection_that_died_within_the_window_fails_once_and_the_pool_recovers(killed: tuple[Engine, int]) -> None:
    engine, dead = killed
    with pytest.raises(OperationalError):
        _backend(engine)
    assert _backend(engine) != dead
