"""Validate and store one ingest batch: atomic, idempotent, and fast (no ORM objects on the hot path).

A batch is one transaction: the dedup record in `ingest_batches`, every event row (`collector.bulk`: COPY
on PostgreSQL, executemany on SQLite, one per event type) and the instance/run upserts commit together or
not at all.
So a retried batch either finds its key (stored once, reported as duplicate) or stores everything.

Source adapters (OTLP spans) build their batch with `batch_from_events` from events validated one by one
and store it here too; a batch that carries span identities claims them in `otlp_spans` in the same
transaction and skips the rows whose span an earlier batch stored.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, bindparam, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from collector import fastdecode, rollup
from collector.bulk import insert_rows
from collector.claims import Claims
from collector.db import translate_errors
from collector.errors import CollectorError, IdempotencyConflictError
from collector.schema import EVENT_TABLES, IngestBatch, Instance, OtlpSpan, Run
from collector.validation import TimeWindow, validate_wire
from collector.wirescan import BatchShapeError, TooManyEventsError
from engine.events import EVENT_TYPES

# Column order of each event table's insert: the event's fields less the discriminator and version.
EVENT_COLUMNS: dict[str, tuple[str, ...]] = {
    kind: tuple(name for name in model.model_fields if name not in ("type", "v")) for kind, model in EVENT_TYPES.items()
}
_GETTERS = {kind: operator.itemgetter(*cols) for kind, cols in EVENT_COLUMNS.items()}
if any(cols[:3] != ("instance", "run_id", "ts") for cols in EVENT_COLUMNS.values()):
    raise ValueError("every event's first fields must be instance, run_id, ts (row layout of _spans)")
if fastdecode.ENABLED and fastdecode.FAST_COLUMNS != EVENT_COLUMNS:
    raise ValueError("collector.fastdecode rows do not match EVENT_COLUMNS")


class BatchValidationError(CollectorError):
    """The batch is rejected whole; `errors` name each offending `events[i].field`."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        first = errors[0] if errors else {"loc": "(body)", "msg": "invalid"}
        super().__init__(f"{first['loc']}: {first['msg']}")


class BatchTooLargeError(CollectorError):
    """More events than `max_batch_events`."""


@dataclass(frozen=True)
class IngestResult:
    batch_id: int
    idempotency_key: str
    events: int
    duplicate: bool
    counts: dict[str, int]


def _loc(loc: tuple[int | str, ...]) -> str:
    """`('events', 3, 'request', 'ttft_s')` -> `events[3].ttft_s` (the union tag is noise to users)."""
    out = ""
    parts = list(loc)
    if len(parts) >= 3 and parts[0] == "events" and isinstance(parts[1], int) and parts[2] in EVENT_TABLES:
        del parts[2]
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(body)"


def format_errors(exc: ValidationError, limit: int = 20) -> list[dict[str, str]]:
    errors = []
    for err in exc.errors(include_url=False)[:limit]:
        errors.append({"loc": _loc(tuple(err["loc"])), "msg": err["msg"], "type": err["type"]})
    return errors


@dataclass
class ParsedBatch:
    """A validated batch: per event type, row tuples in `EVENT_COLUMNS` order, ready for `collector.bulk`."""

    idempotency_key: str | None
    rows: dict[str, list[tuple]]
    count: int
    instances: dict[str, tuple[float, float]]
    runs: dict[tuple[str, str], tuple[float, float]]
    # (trace_id, span_id) of each request row, aligned with rows["request"]; None when not from spans.
    span_ids: list[tuple[str, str]] | None = None


def parse_batch(body: bytes, *, max_events: int, window: TimeWindow | None = None) -> ParsedBatch:
    """Validate a batch body into row tuples; raises BatchValidationError naming `events[i].field`.

    msgspec (collector.fastdecode) is tried first; anything it refuses is judged by the pydantic
    validator (collector.validation), which has the last word and writes the error messages. That one
    counts the events before validating any (`collector.wirescan`) and stops at 20 errors.
    `window`, given for pushes, bounds every event's `ts`.
    """
    fast = fastdecode.decode(body)
    if fast is not None:
        key, rows = fast
    else:
        try:
            key, events = validate_wire(body, max_events=max_events)
        except ValidationError as exc:
            raise BatchValidationError(format_errors(exc)) from None
        except TooManyEventsError as exc:
            raise BatchTooLargeError(str(exc)) from None
        except BatchShapeError as exc:
            raise BatchValidationError([{"loc": exc.loc, "msg": exc.msg, "type": "batch_shape"}]) from None
        if b"\\u0000" in body:
            _reject_nul(key, events)
        grouped: dict[str, list[dict]] = defaultdict(list)
        for event in events:
            grouped[event["type"]].append(event)
        rows = {kind: list(map(_GETTERS[kind], kind_events)) for kind, kind_events in grouped.items()}
    count = sum(len(kind_rows) for kind_rows in rows.values())
    if count > max_events:
        raise BatchTooLargeError(f"batch has {count} events; the limit is {max_events}")
    instances, runs = _spans(rows)
    if window is not None and not all(lo in window and hi in window for lo, hi in runs.values()):
        _reject_time(body, window)
    return ParsedBatch(key, rows, count, instances, runs)


def batch_from_events(
    events: Sequence[dict], *, max_events: int, span_ids: Sequence[tuple[str, str]] | None = None
) -> ParsedBatch:
    """A batch of events a source adapter validated one by one (`collector.validation.validate_event`).

    `span_ids`, when given, names the span of each event (all of type request, in order).
    """
    if len(events) > max_events:
        raise BatchTooLargeError(f"batch has {len(events)} events; the limit is {max_events}")
    grouped: dict[str, list[dict]] = defaultdict(list)
    for event in events:
        grouped[event["type"]].append(event)
    if span_ids is not None and (len(span_ids) != len(events) or set(grouped) - {"request"}):
        raise ValueError("span_ids must name one span per event, and every event must be a request")
    rows = {kind: list(map(_GETTERS[kind], kind_events)) for kind, kind_events in grouped.items()}
    instances, runs = _spans(rows)
    return ParsedBatch(None, rows, len(events), instances, runs, None if span_ids is None else list(span_ids))


def _reject_nul(key: str | None, events: list[dict]) -> None:
    """NUL cannot be stored in PostgreSQL text; name the first string that holds one."""
    if key and "\x00" in key:
        raise BatchValidationError([{"loc": "idempotency_key", "msg": _NUL_MSG, "type": "string_nul"}])
    for i, event in enumerate(events):
        for name, value in event.items():
            if isinstance(value, str) and "\x00" in value:
                raise BatchValidationError([{"loc": f"events[{i}].{name}", "msg": _NUL_MSG, "type": "string_nul"}])


_NUL_MSG = "NUL characters are not allowed in strings"


def _reject_time(body: bytes, window: TimeWindow) -> None:
    """Name the first event whose `ts` is outside `window` (rows lost the events' order; the error path
    decodes the valid body once more to find it)."""
    _, events = validate_wire(body)
    index = next((i for i, event in enumerate(events) if event["ts"] not in window), None)
    loc = "events" if index is None else f"events[{index}].ts"
    raise BatchValidationError([{"loc": loc, "msg": window.message(), "type": "time_window"}])


def _spans(
    rows: dict[str, list[tuple]],
) -> tuple[dict[str, tuple[float, float]], dict[tuple[str, str], tuple[float, float]]]:
    """First/last event time per instance and per (instance, run); rows start (instance, run_id, ts)."""
    runs: dict[tuple[str, str], tuple[float, float]] = {}
    for kind_rows in rows.values():
        keys = {(r[0], r[1]) for r in kind_rows}
        if len(keys) == 1:
            stamps = [r[2] for r in kind_rows]
            spans = {keys.pop(): (min(stamps), max(stamps))}
        else:
            spans = {}
            for r in kind_rows:
                k = (r[0], r[1])
                lo, hi = spans.get(k, (r[2], r[2]))
                spans[k] = (min(lo, r[2]), max(hi, r[2]))
        for k, (lo, hi) in spans.items():
            a, b = runs.get(k, (lo, hi))
            runs[k] = (min(a, lo), max(b, hi))
    instances: dict[str, tuple[float, float]] = {}
    for (instance, _), (lo, hi) in runs.items():
        a, b = instances.get(instance, (lo, hi))
        instances[instance] = (min(a, lo), max(b, hi))
    return instances, runs


@functools.cache
def upsert_statement(dialect: str, table_name: str):
    """INSERT ... ON CONFLICT: keep first_seen, raise last_seen. Built once per dialect, run as executemany."""
    table = {"instances": Instance.__table__, "runs": Run.__table__}[table_name]
    keys = ["name"] if table_name == "instances" else ["instance", "run_id"]
    dialect_insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
    stmt = dialect_insert(table)
    greatest = func.max if dialect == "sqlite" else func.greatest
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={"last_seen_ts": greatest(table.c.last_seen_ts, stmt.excluded.last_seen_ts)},
    )


_BATCHES = IngestBatch.__table__
_INSERT_BATCH = insert(_BATCHES).returning(_BATCHES.c.id)
_FIND_BATCH = select(_BATCHES).where(_BATCHES.c.idempotency_key == bindparam("key"))


def store_batch(
    engine: Engine,
    batch: ParsedBatch,
    *,
    idempotency_key: str | None,
    content: bytes,
    now: float | None = None,
    claims: Claims | None = None,
) -> IngestResult:
    """Store `batch` atomically under `idempotency_key` (a server-made key when None: no dedup).

    `claims` (pushes over HTTP) checks instance ownership and cardinality inside the transaction, before
    any row is written: a refused batch leaves nothing behind."""
    key = idempotency_key or batch.idempotency_key or f"server-{uuid.uuid4().hex}"
    if idempotency_key and batch.idempotency_key and idempotency_key != batch.idempotency_key:
        raise BatchValidationError(
            [{"loc": "idempotency_key", "msg": "differs from the Idempotency-Key header", "type": "value_error"}]
        )
    digest = hashlib.sha256(content).hexdigest()
    received = time.time() if now is None else now

    rows, instances, runs = batch.rows, batch.instances, batch.runs

    with translate_errors():
        existing = _find_batch(engine, key)
        if existing is not None:
            return _duplicate(existing, key, digest)
        try:
            with engine.begin() as conn:
                if batch.span_ids is not None:
                    rows = _claim_spans(conn, rows, batch.span_ids, received)
                    instances, runs = _spans(rows)
                pending = claims.check(conn, rows, received) if claims is not None else None
                count = sum(len(kind_rows) for kind_rows in rows.values())
                batch_id = conn.execute(
                    _INSERT_BATCH,
                    {
                        "idempotency_key": key,
                        "content_sha256": digest,
                        "event_count": count,
                        "received_at": received,
                    },
                ).scalar_one()
                for kind, kind_rows in rows.items():
                    insert_rows(
                        conn, EVENT_TABLES[kind], EVENT_COLUMNS[kind], kind_rows, constants={"batch_id": int(batch_id)}
                    )
                if rows.get("step"):  # the per-minute rollup, current to this batch (`collector.rollup`)
                    rollup.add_steps(conn, rows["step"], EVENT_COLUMNS["step"])
                if instances:
                    # Sorted, so concurrent batches take row locks in one order (no deadlocks on PostgreSQL).
                    dialect = conn.dialect.name
                    conn.execute(
                        upsert_statement(dialect, "instances"),
                        [{"name": n, "first_seen_ts": a, "last_seen_ts": b} for n, (a, b) in sorted(instances.items())],
                    )
                    conn.execute(
                        upsert_statement(dialect, "runs"),
                        [
                            {"instance": i, "run_id": r, "first_seen_ts": a, "last_seen_ts": b}
                            for (i, r), (a, b) in sorted(runs.items())
                        ],
                    )
        except IntegrityError:
            # A concurrent retry of the same batch committed first (the unique key caught it).
            existing = _find_batch(engine, key)
            if existing is None:
                raise
            return _duplicate(existing, key, digest)
    if claims is not None and pending is not None:
        claims.record(pending)
    counts = {kind: len(kind_rows) for kind, kind_rows in rows.items()}
    return IngestResult(batch_id=batch_id, idempotency_key=key, events=count, duplicate=False, counts=counts)


_SPANS = OtlpSpan.__table__
_CLAIM_CHUNK = 500  # rows per INSERT: 3 parameters each, far below SQLite's and PostgreSQL's limits


def _claim_spans(
    conn: Connection, rows: dict[str, list[tuple]], span_ids: list[tuple[str, str]], received: float
) -> dict[str, list[tuple]]:
    """Claim each request row's span in `otlp_spans`; keep only the rows whose span no other batch stored.

    INSERT ... ON CONFLICT DO NOTHING RETURNING names the spans this transaction claimed. On PostgreSQL a
    concurrent batch holding one of them makes this wait for its commit, then skip it. Claims go in sorted
    order, so two batches sharing spans lock them in one order (no deadlock).
    """
    dialect_insert = sqlite.insert if conn.dialect.name == "sqlite" else postgresql.insert
    stmt = dialect_insert(_SPANS).on_conflict_do_nothing().returning(_SPANS.c.trace_id, _SPANS.c.span_id)
    params = [{"trace_id": t, "span_id": s, "received_at": received} for t, s in sorted(set(span_ids))]
    claimed: set[tuple[str, str]] = set()
    for start in range(0, len(params), _CLAIM_CHUNK):
        claimed.update((t, s) for t, s in conn.execute(stmt.values(params[start : start + _CLAIM_CHUNK])))
    kept = [row for row, span in zip(rows.get("request", []), span_ids, strict=True) if span in claimed]
    return {**rows, "request": kept} if kept else {kind: r for kind, r in rows.items() if kind != "request"}


def find_duplicate(engine: Engine, key: str, content: bytes) -> IngestResult | None:
    """The stored batch under `key` if there is one (IdempotencyConflictError if its content differs):
    a retry is answered from this, before its body is parsed."""
    with translate_errors():
        existing = _find_batch(engine, key)
    return None if existing is None else _duplicate(existing, key, hashlib.sha256(content).hexdigest())


def _find_batch(engine: Engine, key: str) -> IngestBatch | None:
    with engine.connect() as conn:
        row = conn.execute(_FIND_BATCH, {"key": key}).first()
    return None if row is None else IngestBatch(**row._asdict())


def _duplicate(existing: IngestBatch, key: str, digest: str) -> IngestResult:
    if existing.content_sha256 != digest:
        raise IdempotencyConflictError(
            f"idempotency key {key!r} was already used for a different batch (batch {existing.id})"
        )
    return IngestResult(
        batch_id=existing.id, idempotency_key=key, events=existing.event_count, duplicate=True, counts={}
    )
