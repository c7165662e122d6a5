"""Alembic environment: the URL comes from the caller (collector.db.upgrade) or CollectorSettings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from collector.partitions import is_postgresql_only
from collector.schema import Base
from collector.settings import CollectorSettings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("kvpilot_url") or CollectorSettings().db_url


def _include_name(name: str | None, type_: str, _parents: object) -> bool:
    """Schema comparison leaves out the day partitions and BRIN indexes of the raw tables (PostgreSQL only)."""
    return name is None or not is_postgresql_only(name, type_)


def _configure(**kwargs: object) -> None:
    url = _url()
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=url.startswith("sqlite"),
        compare_type=True,
        include_name=_include_name,
        **kwargs,
    )


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
