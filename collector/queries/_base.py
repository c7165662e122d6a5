"""Shared plumbing of the read package: the bound connection, dialect-aware bucketing, type aliases."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from sqlalchemy import Connection, Engine, Float, Integer, Table, cast, func, literal
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from collector.db import translate_errors

Db = Session | Connection | Engine
GroupBy = Literal["instance", "run", "all"]
LatencyMetric = Literal["ttft", "e2e", "frontend", "queue", "prefill", "decode", "swap", "tpot"]
Points = dict[str, list[tuple[float, float]]]


DEFAULT_QUANTILES = (0.5, 0.9, 0.95, 0.99)


@contextlib.contextmanager
def _bound(db: Db) -> Iterator[Session | Connection]:
    with translate_errors():
        if isinstance(db, Engine):
            with db.connect() as conn:
                yield conn
        else:
            yield db


def _dialect(conn: Session | Connection) -> str:
    bind = conn.get_bind() if isinstance(conn, Session) else conn
    return bind.dialect.name


def bucket_expr(col: ColumnElement, bucket_s: float, dialect: str) -> ColumnElement:
    """floor(ts / w) * w. SQLite has no floor() without its math extension; CAST truncates, = floor for ts > 0."""
    width = literal(float(bucket_s))
    if dialect == "sqlite":
        return cast(cast(col / width, Integer), Float) * width
    return func.floor(col / width) * width


def _f(v: Any) -> float | None:
    return None if v is None else float(v)


def _int_floor(expr: ColumnElement, dialect: str) -> ColumnElement:
    """floor() as an integer; SQLite's CAST truncates (= floor for x >= 0), PostgreSQL's CAST rounds."""
    if dialect == "sqlite":
        return cast(expr, Integer)
    return cast(func.floor(expr), Integer)


def scope(
    table: Table,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    *,
    ts: str = "ts",
) -> list[ColumnElement]:
    """`table`'s rows with `start <= ts < end` (`ts`: its time column, `bucket_ts` for a rollup), of `instances`
    and of `run_id` where given: the filters every window read starts from."""
    c = table.c
    conds: list[ColumnElement] = [c[ts] >= start, c[ts] < end]
    if instances is not None:
        conds.append(c.instance.in_(instances))
    if run_id is not None:
        conds.append(c.run_id == run_id)
    return conds
