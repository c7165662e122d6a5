"""Engine creation, the session boundary that translates database errors, and schema versioning.

SQLite runs in WAL mode with `synchronous=FULL` by default: the collector answers 202 only after
COMMIT returns, and FULL makes that commit survive power loss, not just a killed process.
PostgreSQL uses psycopg 3 (`postgresql+psycopg://...`); its default `synchronous_commit=on` already
gives the same guarantee.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import CursorResult, Result, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from collector.errors import SchemaOutdatedError, StorageError, StorageUnavailableError

log = logging.getLogger(__name__)

UPGRADE_HINT = "run `kvpilot db upgrade`"


def migrations_dir() -> Path:
    """The Alembic script directory: the top-level `migrations` package, wherever it is installed.

    Located, not imported: Alembic loads its `env.py`, which imports the collector's schema, so an import
    here would make the two packages import each other."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the `migrations` package is not installed next to the collector")
    return Path(spec.origin).resolve().parent


def redact(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE run through a Session matched: the Session types its result as a plain Result,
    but for DML it is a CursorResult."""
    return cast(CursorResult[Any], result).rowcount


def is_sqlite(url_or_engine: str | Engine) -> bool:
    url = url_or_engine.url if isinstance(url_or_engine, Engine) else make_url(url_or_engine)
    return url.get_backend_name() == "sqlite"


def make_engine(url: str, *, sqlite_synchronous: str = "FULL", pool_size: int = 8) -> Engine:
    """An Engine with the pragmas and pool the collector relies on."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            connect_args={"timeout": 30.0, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=4,
        )
        synchronous = sqlite_synchronous.upper()
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError(f"sqlite_synchronous must be FULL, NORMAL or EXTRA, got {sqlite_synchronous!r}")

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    engine = create_engine(parsed, pool_size=pool_size, max_overflow=8)
    ping_when_idle(engine)
    return engine


PING_AFTER_IDLE_S = 1.0


def ping_when_idle(engine: Engine, idle_s: float = PING_AFTER_IDLE_S) -> None:
    """Ping a pooled connection at checkout when it sat in the pool `idle_s` or longer (a dead one is replaced,
    as `pool_pre_ping` does), not when it was checked in moments ago: a busy service checks its connections out
    hundreds of times a second, and a ping on each was a round trip and about 0.1 ms of CPU, a quarter of a
    short transaction's. A connection that dies within `idle_s` of its last use fails its next statement, and
    the pool then drops every connection it holds (the disconnect is detected), as HikariCP's bypass window
    does."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < idle_s:
            return  # new (just connected), or back in the pool moments ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            if engine.dialect.is_disconnect(exc, dbapi_conn, None):
                log.warning("a pooled connection idle %.0f s was gone: replaced", time.monotonic() - since)
                raise DisconnectionError("a pooled connection is gone") from exc
            raise


def memory_engine() -> Engine:
    """A private in-memory SQLite database at the code's schema, gone once disposed: figures computed through
    the collector's own ingest and queries without keeping anything (the simulator's trials). A copy of an empty
    schema made once per process, so each costs milliseconds, not a schema creation."""
    engine = _memory()
    with engine.connect() as conn:
        _sqlite3(conn).deserialize(_empty_schema())
    return engine


def _sqlite3(conn: Connection) -> sqlite3.Connection:
    driver = conn.connection.driver_connection
    if not isinstance(driver, sqlite3.Connection):
        raise TypeError(f"an in-memory SQLite engine holds a sqlite3 connection, not {type(driver).__name__}")
    return driver


def _memory() -> Engine:
    return create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False})


@functools.cache
def _empty_schema() -> bytes:
    from collector.schema import Base

    engine = _memory()
    try:
        Base.metadata.create_all(engine)
        with engine.connect() as conn:
            return _sqlite3(conn).serialize()
    finally:
        engine.dispose()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """The one place SQLAlchemy/driver errors become the collector's own."""
    try:
        yield
    except OperationalError as exc:
        raise StorageUnavailableError(f"database unavailable: {exc.orig or exc}") from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise StorageUnavailableError(f"database connection lost: {exc.orig or exc}") from exc
        raise StorageError(f"database error: {exc.orig or exc}") from exc
    except SQLAlchemyError as exc:
        raise StorageError(f"database error: {exc}") from exc


@contextlib.contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success, rolls back on any error, and translates DB errors."""
    with translate_errors(), factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


# --- Alembic ---------------------------------------------------------------------------------------


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["kvpilot_url"] = url
    return cfg


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()
    if len(heads) != 1:
        raise SchemaOutdatedError(f"migrations have {len(heads)} heads ({heads}); merge them first")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    with translate_errors(), engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(url: str, revision: str = "head") -> None:
    """`kvpilot db upgrade`, callable from code (tests, demo)."""
    cfg = alembic_config(url)
    with translate_errors():
        command.upgrade(cfg, revision)


def check_schema_current(engine: Engine) -> None:
    """Refuse to run on a database that is not exactly at the code's head revision."""
    where = redact(str(engine.url.render_as_string(hide_password=False)))
    current = current_revision(engine)
    head = head_revision()
    if current is None:
        raise SchemaOutdatedError(f"database at {where} is not migrated (no schema version); {UPGRADE_HINT}")
    if current != head:
        script = ScriptDirectory.from_config(alembic_config(str(engine.url)))
        known = {rev.revision for rev in script.walk_revisions()}
        if current not in known:
            raise SchemaOutdatedError(
                f"database at {where} is at revision {current}, which this kvpilot does not know "
                f"(newer kvpilot?); upgrade kvpilot, then {UPGRADE_HINT}"
            )
        raise SchemaOutdatedError(
            f"database at {where} is at revision {current}, not head {head}: it is not migrated to head; {UPGRADE_HINT}"
        )
