"""Whether a push could be stored now: the write half of /health's database check.

Reading the schema version says the database answers, not that it takes writes: on a full disk, a
read-only file or a PostgreSQL standby, /health said 200 while every push got 503. So the probe also
- writes: a transaction updates the one row every kvpilot database has (`alembic_version`, to its own
  value) and rolls back. That fails on a read-only database (a read-only file or mount, a standby,
  `default_transaction_read_only`, a role without the right). A writer holding the lock past
  `lock_wait_s` means the database is busy being written, not refused, and passes.
- measures room, on SQLite (PostgreSQL's disk is not visible from a client): the free bytes of the
  filesystem holding the file, capped by SQLite's own `max_page_count`. Under `min_free_bytes` a push
  may not fit (a rolled-back write allocates no disk in WAL mode, so the write alone cannot tell).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

log = logging.getLogger("kvpilot.collector")


class _FreeBytes(Protocol):
    @property
    def free(self) -> int: ...


DiskUsage = Callable[[str], _FreeBytes]  # shutil.disk_usage's shape
MIB = 2**20


def storage_problem(
    engine: Engine,
    *,
    min_free_bytes: int,
    lock_wait_s: float = 2.0,
    disk_usage: DiskUsage = shutil.disk_usage,
) -> tuple[str, str] | None:
    """None when a push could be written now, else (reason, detail) for /health's 503."""
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                room = _sqlite_room(conn, disk_usage)
                if room is not None and room < min_free_bytes:
                    return (
                        "storage_full",
                        f"{room // MIB} MiB left for the database (at least {min_free_bytes // MIB})",
                    )
            _write_and_roll_back(conn, lock_wait_s)
    except (OperationalError, DBAPIError) as exc:
        message = str(exc.orig or exc).splitlines()[0]
        lowered = message.lower()
        if "database is locked" in lowered or "lock timeout" in lowered:
            return None  # another writer held the lock past lock_wait_s: busy, not refusing
        log.warning("health check: a write failed: %s", message)
        if "full" in lowered or "no space" in lowered:
            return ("storage_full", "the database's disk is full")
        if isinstance(exc, OperationalError) and "read" not in lowered:
            return ("database_unavailable", "database unreachable")
        return ("storage_read_only", "the database refuses writes")
    return None


def _write_and_roll_back(conn: Connection, lock_wait_s: float) -> None:
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(lock_wait_s * 1000)}")
    else:
        conn.exec_driver_sql(f"SET lock_timeout = '{int(lock_wait_s * 1000)}ms'")
    try:
        conn.execute(text("UPDATE alembic_version SET version_num = version_num"))
    finally:
        conn.rollback()


def _sqlite_room(conn: Connection, disk_usage: DiskUsage) -> int | None:
    """Bytes the database may still grow by; None for an in-memory database."""
    database = conn.engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    page_size = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
    pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one()
    free_pages = conn.exec_driver_sql("PRAGMA freelist_count").scalar_one()
    max_pages = conn.exec_driver_sql("PRAGMA max_page_count").scalar_one()
    by_sqlite = (max_pages - pages + free_pages) * page_size
    directory = os.path.dirname(Path(database).expanduser().resolve())
    return min(by_sqlite, disk_usage(directory).free + free_pages * page_size)
