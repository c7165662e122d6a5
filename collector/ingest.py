"""Validate and store ingest batches: atomic, idempotent, and fast (no ORM objects on the hot path).

A batch's dedup record in `ingest_batches`, every event row (`collector.bulk`: COPY on PostgreSQL,
executemany on SQLite, one per event type) and the instance/run upserts commit together or not at all: in the
batch's own transaction (`store_batch`) or in a group's (`store_pushes`: the pushes queued behind a storage
round, each with its own record and its own answer).
So a retried batch either finds its key (stored once, reported as duplicate) or stores everything.

Source adapters (OTLP spans) build their batch with `batch_from_events` from events validated one by one
and store it here too; a batch that carries span identities claims them in `otlp_spans` in the same
transaction and skips the rows whose span an earlier batch stored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from collector import claims as claims_module
from collector import fastdecode, latency_rollup, rollup
from collector.bulk import insert_rows, many_rows_insert, many_rows_params
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
        _merge(runs, spans)
    instances: dict[str, tuple[float, float]] = {}
    for (instance, _), span in runs.items():
        _merge(instances, {instance: span})
    return instances, runs


UPSERT_COLUMNS = {
    "instances": ("name", "first_seen_ts", "last_seen_ts"),
    "runs": ("instance", "run_id", "first_seen_ts", "last_seen_ts"),
}


@functools.cache
def upsert_statement(dialect: str, table_name: str):
    """INSERT ... ON CONFLICT: keep first_seen, raise last_seen. Built once per dialect; its rows go through
    `collector.bulk.many_rows_params`."""
    table = {"instances": Instance.__table__, "runs": Run.__table__}[table_name]
    keys = ["name"] if table_name == "instances" else ["instance", "run_id"]
    stmt = many_rows_insert(dialect, table, UPSERT_COLUMNS[table_name])
    greatest = func.max if dialect == "sqlite" else func.greatest
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={"last_seen_ts": greatest(table.c.last_seen_ts, stmt.excluded.last_seen_ts)},
    )


_BATCHES = IngestBatch.__table__
_INSERT_BATCHES = insert(_BATCHES).returning(_BATCHES.c.id, sort_by_parameter_order=True)


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

    with translate_errors():
        existing = _find_batch(engine, key)
        if existing is not None:
            return _duplicate(existing, key, digest)
        try:
            with engine.begin() as conn:
                if batch.span_ids is not None:
                    rows = _claim_spans(conn, batch.rows, batch.span_ids, received)
                    instances, runs = _spans(rows)
                    batch = dataclasses.replace(batch, rows=rows, instances=instances, runs=runs)
                pending = claims.check(conn, batch.rows, received) if claims is not None else None
                [batch_id] = _write_group(conn, [(key, digest, batch)], received)
        except IntegrityError:
            # A concurrent retry of the same batch committed first (the unique key caught it).
            existing = _find_batch(engine, key)
            if existing is None:
                raise
            return _duplicate(existing, key, digest)
    if claims is not None and pending is not None:
        claims.record(pending)
    return _stored(batch_id, key, batch)


def _stored(batch_id: int, key: str, batch: ParsedBatch) -> IngestResult:
    """The answer for `batch` stored under `batch_id`: its rows counted by event type."""
    counts = {kind: len(kind_rows) for kind, kind_rows in batch.rows.items()}
    return IngestResult(batch_id, key, sum(counts.values()), duplicate=False, counts=counts)


@dataclass(frozen=True)
class Push:
    """One pushed body waiting for the storage stage, with what `parse_batch` and `store_batch` take for it."""

    body: bytes  # what its digest is of (an OTLP export: its spans' identity)
    key: str | None  # the Idempotency-Key header
    claims: Claims | None
    max_events: int
    window: TimeWindow | None = None
    parsed: ParsedBatch | None = None  # a batch a source adapter built (OTLP spans): not parsed again


Outcome = IngestResult | CollectorError


def store_pushes(engine: Engine, pushes: Sequence[Push], *, now: float | None = None) -> list[Outcome]:
    """Parse and store `pushes` in one transaction where they allow it (group commit); one outcome each, in order:
    its result, or the error it alone would have met.

    A fleet pushes many small batches (an engine's second of events), and a batch's cost on PostgreSQL is mostly
    per transaction: the key lookup, the batch record, a COPY per event type, the rollup and the instance/run
    upserts, the claims' reads, the commit's WAL flush. A group pays each once. Each push keeps its own
    guarantees: its body is validated alone, its key is its own record (`ingest_batches`, its own id and
    digest), and it is acknowledged only after the commit that holds its rows. A push joins the group when it
    creates nothing: its key is not stored yet and not repeated in the group, and it names only instances and
    runs that exist and its identity may write (`claims.sort_known`). Anything else (a retry, a key twice, a new
    instance or run, whose bounds and windows count one batch at a time) is stored alone after the group, by
    `store_batch`, as is every member when the group's transaction fails (another collector stored one of its
    keys first): each push then meets exactly what it would have met alone."""
    received = time.time() if now is None else now
    outcomes: list[Outcome | None] = [None] * len(pushes)
    batches: dict[int, ParsedBatch] = {}
    for i, push in enumerate(pushes):
        try:
            batches[i] = push.parsed or parse_batch(push.body, max_events=push.max_events, window=push.window)
        except CollectorError as exc:
            outcomes[i] = exc
    keys: dict[int, str] = {}
    alone: list[int] = []
    for i, batch in batches.items():
        push = pushes[i]
        if push.key and batch.idempotency_key and push.key != batch.idempotency_key:
            alone.append(i)  # store_batch refuses it with the field named
            continue
        key = push.key or batch.idempotency_key
        if key is None:
            keys[i] = f"server-{uuid.uuid4().hex}"
        elif key in keys.values():
            alone.append(i)  # the second of a key: after the first committed, a duplicate of it
        else:
            keys[i] = key
    digests = {i: hashlib.sha256(pushes[i].body).hexdigest() for i in keys}
    with translate_errors():
        stored = _find_batches(engine, list(keys.values()))
    for i in list(keys):
        if keys[i] in stored:
            try:
                outcomes[i] = _duplicate(stored[keys[i]], keys[i], digests[i])
            except CollectorError as exc:
                outcomes[i] = exc
            del keys[i]
    members: list[int] = []
    ids: list[int] = []
    claimed: dict[int, ParsedBatch] = {}
    if keys:
        try:
            with translate_errors():
                try:
                    with engine.begin() as conn:
                        members = _sort_members(conn, pushes, batches, list(keys), outcomes, alone)
                        claimed = _claim_group_spans(conn, batches, members, received)
                        if members:
                            ids = _write_group(conn, [(keys[i], digests[i], claimed[i]) for i in members], received)
                except IntegrityError:  # another collector stored one of the keys first: each alone, in order
                    alone.extend(members)
                    members, ids = [], []
        except CollectorError as exc:  # the database: every member met it
            for i in members or keys:
                outcomes[i] = exc
            members, ids = [], []
    for i, batch_id in zip(members, ids, strict=True):
        outcomes[i] = _stored(batch_id, keys[i], claimed[i])
    for i in sorted(alone):
        push = pushes[i]
        try:
            outcomes[i] = store_batch(
                engine, batches[i], idempotency_key=push.key, content=push.body, now=received, claims=push.claims
            )
        except CollectorError as exc:
            outcomes[i] = exc
    if any(o is None for o in outcomes):
        raise AssertionError("store_pushes left a push without an outcome")
    return outcomes  # type: ignore[return-value]  # every slot filled, checked above


def _claim_group_spans(
    conn: Connection, batches: dict[int, ParsedBatch], candidates: list[int], received: float
) -> dict[int, ParsedBatch]:
    """`batches` with every OTLP member's request rows kept only where its span is claimed in this transaction
    (after the members were sorted: a span is claimed only by the transaction that writes its row;
    `_claim_spans`, all the group's spans at once, in one sorted order; a span two members carry goes to the
    first). A batch that carries no spans is given back as it is."""
    spanned = [i for i in candidates if batches[i].span_ids is not None]
    if not spanned:
        return batches
    every = [span for i in spanned for span in batches[i].span_ids or ()]
    free = set(_claim_span_ids(conn, every, received))
    out = dict(batches)
    for i in spanned:
        batch = batches[i]
        ids = batch.span_ids or []
        keep = [k for k, span in enumerate(ids) if span in free]
        free.difference_update(ids[k] for k in keep)
        requests = batch.rows.get("request", [])
        rows = {kind: r for kind, r in batch.rows.items() if kind != "request"}
        if keep:
            rows["request"] = [requests[k] for k in keep]
        instances, runs = _spans(rows)
        out[i] = dataclasses.replace(batch, rows=rows, instances=instances, runs=runs, span_ids=[ids[k] for k in keep])
    return out


def _sort_members(
    conn: Connection,
    pushes: Sequence[Push],
    batches: dict[int, ParsedBatch],
    candidates: list[int],
    outcomes: list[Outcome | None],
    alone: list[int],
) -> list[int]:
    """Which candidates join the group (the others go `alone`, or get their refusal in `outcomes`)."""
    checked = [i for i in candidates if pushes[i].claims is not None]
    known = claims_module.sort_known(conn, [(pushes[i].claims, batches[i].rows) for i in checked])  # type: ignore[misc]  # filtered to claims
    verdict: dict[int, bool | CollectorError] = dict(zip(checked, known, strict=True))
    members = []
    for i in candidates:
        v = verdict.get(i, True)
        if v is True:
            members.append(i)
        elif v is False:
            alone.append(i)
        else:
            outcomes[i] = v
    return members


def _write_group(conn: Connection, members: list[tuple[str, str, ParsedBatch]], received: float) -> list[int]:
    """Every member's batch record (key, content digest, batch), rows, rollup and instance/run upserts, in `conn`'s
    transaction; the batch ids, in the members' order."""
    params = [
        {
            "idempotency_key": key,
            "content_sha256": digest,
            "event_count": sum(len(rows) for rows in batch.rows.values()),
            "received_at": received,
        }
        for key, digest, batch in members
    ]
    ids = [int(i) for i in conn.execute(_INSERT_BATCHES, params).scalars()]
    for kind, table in EVENT_TABLES.items():
        if len(members) == 1:  # the batch id is a constant: inlined, no row rebuilt
            rows = members[0][2].rows.get(kind)
            if rows:
                insert_rows(conn, table, EVENT_COLUMNS[kind], rows, constants={"batch_id": ids[0]})
            continue
        tagged = [(i, *row) for i, (_, _, b) in zip(ids, members, strict=True) for row in b.rows.get(kind, ())]
        if tagged:
            insert_rows(conn, table, ("batch_id", *EVENT_COLUMNS[kind]), tagged)
    steps = [row for _, _, b in members for row in b.rows.get("step", ())]
    if steps:  # the per-minute rollup, current to this transaction (`collector.rollup`)
        rollup.add_steps(conn, steps, EVENT_COLUMNS["step"])
    allocs = [row for _, _, b in members for row in b.rows.get("alloc", ())]
    if allocs:
        rollup.add_allocs(conn, allocs, EVENT_COLUMNS["alloc"])
    samples = [row for _, _, b in members for row in b.rows.get("sample", ())]
    if samples:
        rollup.add_samples(conn, samples, EVENT_COLUMNS["sample"])
    requests = [row for _, _, b in members for row in b.rows.get("request", ())]
    if requests:  # rows the latency sketch has rolled past (`collector.latency_rollup`)
        latency_rollup.add_late(conn, requests, EVENT_COLUMNS["request"])
    instances: dict[str, tuple[float, float]] = {}
    runs: dict[tuple[str, str], tuple[float, float]] = {}
    for _, _, b in members:
        _merge(instances, b.instances)
        _merge(runs, b.runs)
    if instances:
        # Sorted, so concurrent transactions take row locks in one order (no deadlocks on PostgreSQL; unnest
        # yields the rows in their arrays' order).
        dialect = conn.dialect.name
        instance_rows = [{"name": n, "first_seen_ts": a, "last_seen_ts": z} for n, (a, z) in sorted(instances.items())]
        run_rows = [
            {"instance": i, "run_id": r, "first_seen_ts": a, "last_seen_ts": z}
            for (i, r), (a, z) in sorted(runs.items())
        ]
        conn.execute(upsert_statement(dialect, "instances"), many_rows_params(conn, instance_rows))
        conn.execute(upsert_statement(dialect, "runs"), many_rows_params(conn, run_rows))
    return ids


def _merge(into: dict, spans: dict) -> None:
    """Widen each key's (first, last) time span in `into` by `spans`'."""
    for k, (lo, hi) in spans.items():
        a, z = into.get(k, (lo, hi))
        into[k] = (min(a, lo), max(z, hi))


def _find_batches(engine: Engine, keys: list[str]) -> dict[str, IngestBatch]:
    found: dict[str, IngestBatch] = {}
    if not keys:
        return found
    with engine.connect() as conn:
        for start in range(0, len(keys), _KEY_CHUNK):
            chunk = keys[start : start + _KEY_CHUNK]
            for row in conn.execute(select(_BATCHES).where(_BATCHES.c.idempotency_key.in_(chunk))):
                found[row.idempotency_key] = IngestBatch(**row._asdict())
    return found


_KEY_CHUNK = 400  # keys per IN list
_SPANS = OtlpSpan.__table__
_CLAIM_CHUNK = 500  # rows per INSERT: 3 parameters each, far below SQLite's and PostgreSQL's limits


def _claim_spans(
    conn: Connection, rows: dict[str, list[tuple]], span_ids: list[tuple[str, str]], received: float
) -> dict[str, list[tuple]]:
    """Claim each request row's span in `otlp_spans`; keep only the rows whose span no other batch stored."""
    claimed = _claim_span_ids(conn, span_ids, received)
    kept = [row for row, span in zip(rows.get("request", []), span_ids, strict=True) if span in claimed]
    return {**rows, "request": kept} if kept else {kind: r for kind, r in rows.items() if kind != "request"}


def _claim_span_ids(conn: Connection, span_ids: list[tuple[str, str]], received: float) -> set[tuple[str, str]]:
    """The spans of `span_ids` this transaction claimed in `otlp_spans` (those no other batch stored).

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
    return claimed


def find_duplicate(engine: Engine, key: str, content: bytes) -> IngestResult | None:
    """The stored batch under `key` if there is one (IdempotencyConflictError if its content differs):
    a retry is answered from this, before its body is parsed."""
    with translate_errors():
        existing = _find_batch(engine, key)
    return None if existing is None else _duplicate(existing, key, hashlib.sha256(content).hexdigest())


def _find_batch(engine: Engine, key: str) -> IngestBatch | None:
    return _find_batches(engine, [key]).get(key)


def _duplicate(existing: IngestBatch, key: str, digest: str) -> IngestResult:
    if existing.content_sha256 != digest:
        raise IdempotencyConflictError(
            f"idempotency key {key!r} was already used for a different batch (batch {existing.id})"
        )
    return IngestResult(
        batch_id=existing.id, idempotency_key=key, events=existing.event_count, duplicate=True, counts={}
    )
