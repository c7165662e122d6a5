"""Where studies live: Optuna's RDB storage next to the collector's tables.

Optuna's RDB storage keeps its own Alembic version in a table named `alembic_version` — the same name
kvpilot's schema uses — so the two cannot share one SQL namespace without one clobbering the other's
version. On PostgreSQL the study therefore lives in the same database, in its own schema
(`<current schema>_optuna`, default `kvpilot_optuna`): parallel tuner workers share it like any other
table. On SQLite (one writer, no schemas) it lives in a sibling file `<db>-optuna.db`.
`KVPILOT_TUNER_STORAGE_URL` (or `--storage`) names another storage explicitly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

log = logging.getLogger("kvpilot.tuner.storage")

STORAGE_ENV = "KVPILOT_TUNER_STORAGE_URL"


def _search_path(options: str | None) -> str | None:
    for part in (options or "").split():
        if part.startswith("-csearch_path="):
            return part.split("=", 1)[1].split(",")[0].strip('"')
    return None


def optuna_storage_url(db_url: str) -> str:
    """The Optuna storage URL that belongs to the kvpilot database `db_url`."""
    explicit = os.environ.get(STORAGE_ENV)
    if explicit:
        return explicit
    url = make_url(db_url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        database = url.database
        if not database or database == ":memory:":
            return "sqlite://"
        path = Path(database)
        return url.set(database=str(path.with_name(f"{path.stem}-optuna{path.suffix or '.db'}"))).render_as_string(
            hide_password=False
        )
    if backend == "postgresql":
        options = url.query.get("options")
        if isinstance(options, tuple):
            options = " ".join(options)
        schema = f"{_search_path(options) or 'kvpilot'}_optuna"
        rest = [p for p in (options or "").split() if not p.startswith("-csearch_path=")]
        new = url.update_query_dict({"options": " ".join([*rest, f"-csearch_path={schema}"])})
        return new.render_as_string(hide_password=False)
    return db_url


def ensure_schema(storage_url: str) -> None:
    """Create the PostgreSQL schema the storage URL's search_path names (no-op elsewhere)."""
    url = make_url(storage_url)
    if url.get_backend_name() != "postgresql":
        return
    options = url.query.get("options")
    schema = _search_path(" ".join(options) if isinstance(options, tuple) else options)
    if not schema:
        return
    engine = create_engine(url.difference_update_query(["options"]), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            try:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
            except (IntegrityError, ProgrammingError):  # another worker created it at the same moment
                log.info("optuna schema %s created concurrently by another worker", schema)
    finally:
        engine.dispose()


def open_storage(db_url: str | None, *, storage_url: str | None = None):
    """An Optuna storage for the kvpilot database (in memory when `db_url` is None)."""
    import optuna

    if db_url is None and storage_url is None:
        return optuna.storages.InMemoryStorage()
    url = storage_url or optuna_storage_url(db_url)
    if url in ("sqlite://", "sqlite:///:memory:"):
        return optuna.storages.InMemoryStorage()
    ensure_schema(url)
    kwargs = {"pool_pre_ping": True} if make_url(url).get_backend_name() == "postgresql" else {}
    if make_url(url).get_backend_name() == "sqlite":
        kwargs = {"connect_args": {"timeout": 30.0}}
    log.info("optuna storage: %s", make_url(url).render_as_string(hide_password=True))
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except (IntegrityError, ProgrammingError, OperationalError) as exc:
            # Two workers creating Optuna's tables at once: the loser sees them half made; try again.
            if attempt == 2:
                raise
            log.info("optuna storage: concurrent table creation (%s); retrying", type(exc).__name__)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")
