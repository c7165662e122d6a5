"""POST /v1/ingest: one batch of wire events, stored atomically and idempotently.

The handler stays thin. Under admission control (`admission`: a slot, a byte budget, a
turn at the storage stage) it reads and bounds the body (size, media type), inflates it in a worker
thread, answers a retry whose Idempotency-Key is stored straight away (no parsing), and hands the rest
to `collector.ingest` in a worker thread. A 202 is sent only after the batch's transaction committed:
acknowledged means durable.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from collector.claims import Claims
from collector.errors import CollectorError
from collector.ingest import IngestResult, Push, find_duplicate, store_pushes
from collector.server.admission import Ticket, client_gone, read_body
from collector.server.deps import CollectorState, IngestIdentity, StateDep, require_token
from collector.server.errors import ERROR_RESPONSES, Rejected
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


async def decode_body(request: Request, raw: bytes, state: CollectorState, ticket: Ticket) -> bytes:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise Rejected(415, "unsupported_media", f"content-type must be application/json, got {ctype!r}")
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
    """Validate and store one round of pushes in a worker thread, one round at a time (the storage stage's).

    Validation and the inserts both need the GIL. Overlapping them across threads buys nothing: the
    drivers release the GIL around every row they step, then wait for a validator that holds it for
    a whole batch (a lock convoy). Overlapping only the COMMIT's fsync with the next validation was
    tried and measured no faster on 2 cores, so each round simply runs alone; the event loop keeps
    receiving the next bodies meanwhile, and the pushes that queue behind a round are the next one's group
    (`collector.ingest.store_pushes`: one transaction for them all).
    """
    with state.ingest_lock:
        return store_pushes(state.engine, pushes)


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
            settings = state.settings
            push = Push(
                body,
                idempotency_key,
                Claims(identity, state.windows),
                max_events=settings.max_batch_events,
                window=TimeWindow.for_settings(settings),
            )

            async def store(pushes: list[Push]) -> list[IngestResult | CollectorError]:
                started = time.perf_counter()
                try:
                    return await run_in_threadpool(store_sync, state, pushes)
                finally:  # every batch of the round took the round's time to its commit
                    for _ in pushes:
                        state.metrics.latency.observe(time.perf_counter() - started)

            result = await state.admission.store(request, push, store, group=True, size=len(body))
    return _answer(state, result)


def _answer(state: CollectorState, result: IngestResult) -> JSONResponse:
    if result.duplicate:
        state.metrics.batches.labels("duplicate").inc()
        log.info("duplicate batch %s (key %s) not stored again", result.batch_id, result.idempotency_key)
    else:
        state.metrics.batches.labels("accepted").inc()
        for kind, n in result.counts.items():
            state.metrics.events.labels(kind).inc(n)
    payload = IngestResponse(
        batch_id=result.batch_id,
        idempotency_key=result.idempotency_key,
        events=result.events,
        duplicate=result.duplicate,
    )
    return JSONResponse(payload.model_dump(), status_code=200 if result.duplicate else 202)
