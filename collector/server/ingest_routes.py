"""POST /v1/ingest: one batch of wire events, stored atomically and idempotently.

The handler stays thin (STYLE.md 10): it reads and bounds the body (size, gzip, media type), then hands
it to `collector.ingest` in a worker thread. A 202 is sent only after the batch's transaction committed:
acknowledged means durable.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from collector.ingest import IngestResult, parse_batch, store_batch
from collector.server.deps import CollectorState, StateDep, require_token
from collector.server.errors import ERROR_RESPONSES, Rejected
from collector.settings import CollectorSettings

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


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Rejected(413, "too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise Rejected(413, "too_large", f"body exceeds the limit of {limit} bytes")
    return bytes(buf)


def gunzip_limited(data: bytes, limit: int, *, coding: Literal["gzip", "deflate"] = "gzip") -> bytes:
    """Decompress one gzip member (or zlib stream: HTTP's deflate), refusing output past `limit` (zip bombs)
    and trailing junk."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS)
    reason = f"bad_{coding}"
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise Rejected(400, reason, f"body is not valid {coding}: {exc}") from exc
    if len(out) > limit or inflater.unconsumed_tail:
        raise Rejected(413, "too_large", f"decompressed body exceeds the limit of {limit} bytes")
    if not inflater.eof:
        raise Rejected(400, reason, f"{coding} body is truncated")
    if inflater.unused_data:
        raise Rejected(400, reason, f"data after the end of the {coding} stream")
    return out


def decode_body(request: Request, raw: bytes, settings: CollectorSettings) -> bytes:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise Rejected(415, "unsupported_media", f"content-type must be application/json, got {ctype!r}")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "gzip":
        return gunzip_limited(raw, settings.max_decompressed_bytes)
    if encoding in ("identity", ""):
        return raw
    raise Rejected(415, "unsupported_encoding", f"content-encoding must be gzip or identity, got {encoding!r}")


def ingest_sync(state: CollectorState, body: bytes, key: str | None) -> IngestResult:
    """Validate and store one batch in a worker thread, one batch at a time.

    Validation and the inserts both need the GIL. Overlapping them across threads buys nothing: the
    drivers release the GIL around every row they step, then wait for a validator that holds it for
    a whole batch (a lock convoy). Overlapping only the COMMIT's fsync with the next validation was
    tried and measured no faster on 2 cores, so each batch simply runs under `ingest_lock`; the event
    loop keeps receiving the next bodies meanwhile.
    """
    with state.ingest_lock:
        batch = parse_batch(body, max_events=state.settings.max_batch_events)
        return store_batch(state.engine, batch, idempotency_key=key, content=body)


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
async def ingest(request: Request, state: StateDep, idempotency_key: IdempotencyKey = None) -> JSONResponse:
    """Store one batch atomically. 202: committed. 200 with duplicate=true: stored before."""
    raw = await read_limited(request, state.settings.max_batch_bytes)
    state.metrics.bytes.inc(len(raw))
    body = decode_body(request, raw, state.settings)
    started = time.perf_counter()
    result = await run_in_threadpool(ingest_sync, state, body, idempotency_key)
    state.metrics.latency.observe(time.perf_counter() - started)
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
