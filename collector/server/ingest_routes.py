"""POST /v1/ingest: one batch of wire events, stored atomically and idempotently; POST /v1/ingest/bundle:
several such pushes in one request (`collector.bundle`, what a node relay forwards), each member stored and
answered exactly as it would have been alone, all of them in one storage round.

The handlers stay thin. Under admission control (`admission`: a slot, a byte budget, a
turn at the storage stage) it reads and bounds the body (size, media type), inflates it in a worker
thread, answers a retry whose Idempotency-Key is stored straight away (no parsing), and hands the rest
to `collector.ingest` in a worker thread. A 202 is sent only after the batch's transaction committed:
acknowledged means durable.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from collector import bundle
from collector.claims import Claims
from collector.errors import CollectorError
from collector.ingest import IngestResult, Push, find_duplicate, parse_batch, store_pushes
from collector.server.admission import Ticket, client_gone, read_body
from collector.server.deps import CollectorState, IngestIdentity, StateDep, require_token
from collector.server.errors import ERROR_RESPONSES, Rejected, as_rejected
from collector.validation import TimeWindow

log = logging.getLogger("kvpilot.collector")

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

IdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200, pattern=r"^[!-~]+$")
]


class IngestResponse(BaseModel):
    batch_id: int
    idempotency_key: str
    events: int
    duplicate: bool


class BundleResult(BaseModel):
    """One member's answer: `status` as a lone push's (202, 200 duplicate, or its refusal's with `detail`)."""

    status: int
    key: str | None = None
    batch_id: int | None = None
    idempotency_key: str | None = None
    events: int | None = None
    duplicate: bool | None = None
    detail: str | None = None
    errors: list[dict[str, Any]] | None = None


class BundleResponse(BaseModel):
    results: list[BundleResult]


async def decode_body(
    request: Request, raw: bytes, state: CollectorState, ticket: Ticket, media: str = "application/json"
) -> bytes:
    ctype = request.headers.get("content-type", media).split(";")[0].strip().lower()
    if ctype != media:
        raise Rejected(415, "unsupported_media", f"content-type must be {media}, got {ctype!r}")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("identity", ""):
        return raw
    if encoding != "gzip":
        raise Rejected(415, "unsupported_encoding", f"content-encoding must be gzip or identity, got {encoding!r}")
    if await request.is_disconnected():
        raise client_gone()
    limit = state.settings.max_decompressed_bytes
    return await state.admission.inflate(raw, limit=limit, ticket=ticket)


def store_sync(state: CollectorState, pushes: list[Push]) -> list[IngestResult | CollectorError]:
    """Store one round of (parsed) pushes in a worker thread, one round at a time (the storage stage's).

    The pushes were parsed and validated as they arrived (`_parse_ahead`), so the next round's parsing
    overlaps this round's time in the database. The writes of two rounds do not overlap: both need the GIL,
    and the drivers release it around every row they step, then wait for the other holder (a lock convoy).
    The pushes that queue behind a round are the next one's group (`collector.ingest.store_pushes`: one
    transaction for them all).
    """
    with state.ingest_lock:
        return store_pushes(state.engine, pushes)


@dataclass(frozen=True)
class Bundled:
    """A bundle's pushes: one item at the storage stage (they share a round), one outcome each."""

    pushes: list[Push]


def round_store(state: CollectorState) -> Callable[[list[Any]], Awaitable[list[Any]]]:
    """The storage round of the pushes and bundles a leader took: all their pushes in one `store_sync`, each
    item given back its own outcome (a bundle: its members', in order)."""

    async def store(items: list[Push | Bundled]) -> list[Any]:
        pushes = [p for item in items for p in (item.pushes if isinstance(item, Bundled) else [item])]
        started = time.perf_counter()
        try:
            outcomes = await run_in_threadpool(store_sync, state, pushes)
        finally:  # every batch of the round took the round's time to its commit
            for _ in pushes:
                state.metrics.latency.observe(time.perf_counter() - started)
        rest = iter(outcomes)
        return [[next(rest) for _ in item.pushes] if isinstance(item, Bundled) else next(rest) for item in items]

    return store


@router.post(
    "/ingest",
    status_code=202,
    response_model=IngestResponse,
    responses={200: {"model": IngestResponse, "description": "duplicate of a stored batch"}, **ERROR_RESPONSES},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EventBatch"}}},
        }
    },
)
async def ingest(
    request: Request, state: StateDep, identity: IngestIdentity, idempotency_key: IdempotencyKey = None
) -> JSONResponse:
    """Store one batch atomically. 202: committed. 200 with duplicate=true: stored before.
    429/503 with Retry-After: overloaded, retry the same batch later."""
    async with state.admission.admit() as ticket:
        raw = await read_body(request, ticket, state.settings.max_batch_bytes)
        state.metrics.bytes.inc(len(raw))
        body = await decode_body(request, raw, state, ticket)
        result = None
        if idempotency_key is not None:
            result = await run_in_threadpool(find_duplicate, state.engine, idempotency_key, body)
        if result is None:
            [push] = await _parse_ahead(state, ticket, [_push(state, identity, body, idempotency_key)])
            if isinstance(push, CollectorError):
                raise push
            result = await state.admission.store(request, push, round_store(state), group=True, size=len(body))
    _count(state, result)
    return JSONResponse(_payload(result), status_code=200 if result.duplicate else 202)


@router.post(
    bundle.PATH.removeprefix("/v1"),
    response_model=BundleResponse,
    responses=ERROR_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {bundle.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def ingest_bundle(request: Request, state: StateDep, identity: IngestIdentity) -> JSONResponse:
    """Several pushes (a node relay's; `collector.bundle` says the form) stored in one round, each answered
    as if alone: 200 with one result per member, in order (its status: 202, 200 duplicate, or its refusal's
    4xx/503 with the detail). A refusal of the whole bundle (400 bad form, 413, 415, 429, 503) stores none."""
    settings = state.settings
    async with state.admission.admit() as ticket:
        raw = await read_body(request, ticket, settings.max_batch_bytes)
        state.metrics.bytes.inc(len(raw))
        body = await decode_body(request, raw, state, ticket, media=bundle.MEDIA_TYPE)
        try:
            members = bundle.decode(body, max_members=settings.ingest_group_max_batches)
        except bundle.BundleError as exc:
            raise Rejected(400, "bad_bundle", f"bundle rejected, nothing stored: {exc}") from None
        parsed = await _parse_ahead(state, ticket, [_push(state, identity, m.body, m.key) for m in members])
        item = Bundled([p for p in parsed if isinstance(p, Push)])
        stored: list[Any] = []
        if item.pushes:  # the members that parsed take one turn at the storage stage
            size, count = len(body), len(item.pushes)
            stored = await state.admission.store(request, item, round_store(state), group=True, size=size, count=count)
        rest = iter(stored)
        outcomes = [p if isinstance(p, CollectorError) else next(rest) for p in parsed]
    results = []
    retry_after = None
    for member, outcome in zip(members, outcomes, strict=True):
        if isinstance(outcome, CollectorError):
            refusal = as_rejected(outcome)
            state.metrics.rejected.labels(refusal.reason).inc()
            state.refusal_log(refusal.reason, f"bundle member {member.key} -> {refusal.status_code} {refusal.detail}")
            if refusal.headers and "Retry-After" in refusal.headers:
                retry_after = refusal.headers["Retry-After"]
            shown = {"detail": refusal.detail, **({"errors": refusal.errors} if refusal.errors else {})}
            results.append({"key": member.key, "status": refusal.status_code, **shown})
        else:
            _count(state, outcome)
            results.append({"key": member.key, "status": 200 if outcome.duplicate else 202, **_payload(outcome)})
    headers = {"Retry-After": retry_after} if retry_after else None
    return JSONResponse({"results": results}, status_code=200, headers=headers)


async def _parse_ahead(state: CollectorState, ticket: Ticket, pushes: list[Push]) -> list[Push | CollectorError]:
    """Each push parsed and validated in a worker thread before it queues for the storage stage, so the pushes
    queued behind a round are parsed while the round is in the database (one collector stored 25% more
    pushes a minute in the fleet bench); an invalid push gets its refusal here, without a turn. The rows'
    memory is reserved against the byte budget (429 past it) for as long as the push is admitted."""

    def parse() -> list[Push | CollectorError]:
        out: list[Push | CollectorError] = []
        for push in pushes:
            try:
                batch = parse_batch(push.body, max_events=push.max_events, window=push.window)
                out.append(dataclasses.replace(push, parsed=batch))
            except CollectorError as exc:
                out.append(exc)
        return out

    parsed = await run_in_threadpool(parse)
    ticket.reserve_rows(sum(p.parsed.count for p in parsed if isinstance(p, Push) and p.parsed))
    return parsed


def _push(state: CollectorState, identity: str, body: bytes, key: str | None) -> Push:
    settings = state.settings
    return Push(
        body,
        key,
        Claims(identity, state.windows),
        max_events=settings.max_batch_events,
        window=TimeWindow.for_settings(settings),
    )


def _count(state: CollectorState, result: IngestResult) -> None:
    if result.duplicate:
        state.metrics.batches.labels("duplicate").inc()
        log.info("duplicate batch %s (key %s) not stored again", result.batch_id, result.idempotency_key)
    else:
        state.metrics.batches.labels("accepted").inc()
        for kind, n in result.counts.items():
            state.metrics.events.labels(kind).inc(n)


def _payload(result: IngestResult) -> dict[str, Any]:
    return IngestResponse(
        batch_id=result.batch_id,
        idempotency_key=result.idempotency_key,
        events=result.events,
        duplicate=result.duplicate,
    ).model_dump()
