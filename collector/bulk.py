"""Bulk inserts of raw rows, the one place that picks the writer by dialect: COPY on PostgreSQL,
executemany on SQLite.

The ingest fast path and the scraper hand over plain tuples in column order. On PostgreSQL they go through
psycopg's `cursor.copy()` (`COPY table (cols) FROM STDIN`, binary format) on the SQLAlchemy connection's
own driver connection, so they join its transaction: a batch's dedup record, its rows and the upserts
still commit together or not at all. COPY skips the per-row statement round of executemany (PostgreSQL's
own guide, "Populating a Database": use COPY to load many rows); binary skips formatting each value as
text and parsing it back (`kvpilot bench ingest` measures both writers against each other).

Upserts of many rows (the instance and run records, the rollups) go as one statement on PostgreSQL:
`INSERT ... SELECT * FROM unnest(:a, :b, ...)`, one array per column, so a round's hundreds of rows are one
execution and one plan (`many_rows_insert`, `many_rows_params`); executemany sends each row its own Bind and
Execute and steps each through psycopg and the server (measured: a 256-row upsert took 2.7 ms of the
client's CPU and 5.4 ms to commit, 0.85 ms and 2.1 ms through unnest). SQLite runs the same INSERT as an
executemany of the rows.

SQLite keeps the raw executemany of the same tuples (SQLAlchemy's per-row bind processing would cost more
than the driver itself). Values the same in every row (an ingest batch's id) are our own integers, inlined
as literals there and prepended to each row for COPY.

Driver errors raised by the COPY are handed on as SQLAlchemy's own exception classes, so callers translate
them at the same boundary as every other statement (`collector.db.translate_errors`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import psycopg
from sqlalchemy import BigInteger, Boolean, Connection, Float, Integer, String, Table, Text, bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

CopyFormat = Literal["binary", "text"]
COPY_FORMAT: CopyFormat = "binary"


def insert_rows(
    conn: Connection,
    table: Table,
    columns: Sequence[str],
    rows: Iterable[tuple],
    *,
    constants: dict[str, int | None] | None = None,
    copy_format: CopyFormat = COPY_FORMAT,
) -> None:
    """Insert `rows` (tuples in `columns` order) into `table` inside `conn`'s transaction.

    `constants` name columns whose value is the same in every row (integers or None only: they are
    inlined into SQL)."""
    constants = constants or {}
    if any(value is not None and type(value) is not int for value in constants.values()):
        raise TypeError("constants must be integers or None")
    if conn.dialect.name == "postgresql":
        copy_rows(conn, table, columns, rows, constants=constants, copy_format=copy_format)
    else:
        sql = executemany_sql(conn.dialect.paramstyle, table.name, tuple(columns), tuple(constants))
        conn.exec_driver_sql(sql.format(*(_literal(v) for v in constants.values())), list(rows))


def copy_rows(
    conn: Connection,
    table: Table,
    columns: Sequence[str],
    rows: Iterable[tuple],
    *,
    constants: dict[str, int | None],
    copy_format: CopyFormat = COPY_FORMAT,
) -> None:
    """COPY ... FROM STDIN on the connection's psycopg connection (PostgreSQL only)."""
    names = (*constants, *columns)
    statement = copy_statement(table.name, names, copy_format)
    prefix = tuple(constants.values())
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(f"COPY needs a psycopg connection, not {type(driver).__name__}")
    try:
        with driver.cursor() as cur, cur.copy(statement) as copy:
            if copy_format == "binary":
                copy.set_types(list(pg_types(table, names)))
            if prefix:
                for row in rows:
                    copy.write_row((*prefix, *row))
            else:
                for row in rows:
                    copy.write_row(row)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise DBAPIError.instance(
            statement,
            None,
            exc,
            conn.dialect.loaded_dbapi.Error,
            connection_invalidated=conn.dialect.is_disconnect(exc, conn.connection, None),
            dialect=conn.dialect,
        ) from exc


@functools.cache
def many_rows_insert(dialect: str, table: Table, columns: tuple[str, ...]) -> postgresql.Insert | sqlite.Insert:
    """An INSERT of many rows of `columns` as one statement: on PostgreSQL from `unnest` of one array per column,
    whose parameters `many_rows_params` builds; on SQLite the plain INSERT, run as executemany. Either takes
    `.on_conflict_do_update` (its `excluded` is the row that met the conflict). The rows must not repeat a
    conflict key (one statement may not update a row twice)."""
    if dialect != "postgresql":
        return sqlite.insert(table)
    arrays = [bindparam(c, type_=postgresql.ARRAY(table.c[c].type)) for c in columns]
    given = func.unnest(*arrays).table_valued(*columns).render_derived(name="given")
    return postgresql.insert(table).from_select(list(columns), select(*(given.c[c] for c in columns)))


def many_rows_params(conn: Connection, rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]] | list[dict[str, Any]]:
    """`rows` (one or more, each keyed by the statement's columns) as `many_rows_insert` on `conn` takes them: a
    list per column on PostgreSQL (its arrays are bound by name), the rows elsewhere."""
    if not rows:
        raise ValueError("many_rows_params needs at least one row")
    if conn.dialect.name == "postgresql":
        return {c: [row[c] for row in rows] for c in rows[0]}
    return list(rows)


@functools.cache
def copy_statement(table: str, columns: tuple[str, ...], copy_format: CopyFormat) -> str:
    options = " (FORMAT BINARY)" if copy_format == "binary" else ""
    return f"COPY {table} ({', '.join(columns)}) FROM STDIN{options}"


@functools.cache
def executemany_sql(paramstyle: str, table: str, columns: tuple[str, ...], constants: tuple[str, ...] = ()) -> str:
    """INSERT of `constants` (as `{}` slots for literals) and `columns` (driver parameters)."""
    mark = "?" if paramstyle == "qmark" else "%s"
    names = ", ".join((*constants, *columns))
    values = ", ".join(["{}"] * len(constants) + [mark] * len(columns))
    return f"INSERT INTO {table} ({names}) VALUES ({values})"


def _literal(value: int | None) -> str:
    return "NULL" if value is None else str(int(value))


@functools.cache
def pg_types(table: Table, columns: tuple[str, ...]) -> tuple[str, ...]:
    """PostgreSQL type names of `columns` for binary COPY (which sends each value in its type's own layout)."""
    return tuple(_pg_type(table, name) for name in columns)


def _pg_type(table: Table, name: str) -> str:
    column_type = table.c[name].type
    if isinstance(column_type, BigInteger):
        return "int8"
    if isinstance(column_type, Integer):
        return "int4"
    if isinstance(column_type, Float):
        return "float8"
    if isinstance(column_type, Boolean):
        return "bool"
    if isinstance(column_type, String | Text):
        return "text"
    raise TypeError(f"no COPY type for {table.name}.{name} ({column_type!r})")
