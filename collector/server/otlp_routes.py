"""POST /v1/traces: OTLP/HTTP trace export; vLLM's `llm_request` spans are stored as request rows.

The handler stays thin, as /v1/ingest's: the same ingest token, admission control
(`admission`), body limits (wire and inflated; inflated in a worker thread), ownership and cardinality
bounds (`collector.claims`) and storage path (`collector.otlp` turns spans into request events; the
export is then a push like any other, group-committed with the pushes queued beside it, its spans claimed
in that transaction so that a span exported twice is stored once). Answers follow the OTLP/HTTP spec, in the request's
encoding: 200 with an ExportTraceServiceResponse (`partial_success` when llm_request spans were
rejected); a refusal as a google.rpc.Status (`status_response`, which the app's one refusal handler
calls for this path): 400 an undecodable body, 401/403 the token, 409 an instance owned by another
identity, 413 too large or too many spans, 415 the media type or content coding, 422 past a
cardinality bound, 429 (overloaded, or a per-minute bound) and 503 (the database unavailable or the
bottleneck) with Retry-After, which the exporter honours.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from collector import otlp
from collector.claims import Claims
from collector.ingest import IngestResult, ParsedBatch, Push, batch_from_events
from collector.server.admission import Ticket, client_gone, read_body
from collector.server.deps import CollectorState, IngestIdentity, IngestMetrics, StateDep, require_token
from collector.server.errors import ERROR_RESPONSES, Rejected
from collector.server.ingest_routes import round_store
from collector.validation import TimeWindow

log = logging.getLogger("kvpilot.collector")

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

TRACES_PATH = "/v1/traces"
MEDIA_TYPES: dict[otlp.Media, str] = {"protobuf": "application/x-protobuf", "json": "application/json"}
_BY_TYPE = {value: key for key, value in MEDIA_TYPES.items()}


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def request_media(request: Request) -> otlp.Media:
    media = _BY_TYPE.get(_content_type(request))
    if media is None:
        raise Rejected(415, "unsupported_media", "content-type must be application/x-protobuf or application/json")
    return media


async def decode_body(request: Request, raw: bytes, state: CollectorState, ticket: Ticket) -> bytes:
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding in ("identity", ""):
        return raw
    if coding not in ("gzip", "deflate"):
        raise Rejected(415, "unsupported_encoding", "content-encoding must be gzip, deflate or identity")
    if await request.is_disconnected():
        raise client_gone()
    limit = state.settings.max_decompressed_bytes
    return await state.admission.inflate(raw, limit=limit, ticket=ticket, coding=coding)  # type: ignore[arg-type]  # gzip or deflate, checked above


def status_response(request: Request, exc: Rejected) -> Response:
    """A refusal of this path as the spec has it: a google.rpc.Status in the request's encoding."""
    media: otlp.Media = "json" if _content_type(request) == MEDIA_TYPES["json"] else "protobuf"
    return Response(
        otlp.status_body(exc.status_code, exc.detail, media),
        status_code=exc.status_code,
        media_type=MEDIA_TYPES[media],
        headers=exc.headers,
    )


def decode_export(state: CollectorState, body: bytes, media: otlp.Media) -> tuple[otlp.SpanBatch, ParsedBatch | None]:
    """Decode and convert one export in a worker thread as it arrives (its request rows as a batch; None when
    it holds no llm_request span), while the storage stage stores the round before it."""
    settings = state.settings
    request = otlp.parse_request(body, media, max_spans=settings.otlp_max_spans)
    spans = otlp.request_events(
        request,
        instance_map=settings.otlp_instance_map,
        max_spans=settings.otlp_max_spans,
        window=TimeWindow.for_settings(settings),
    )
    if not spans.events:
        return spans, None
    return spans, batch_from_events(spans.events, max_events=settings.otlp_max_spans, span_ids=spans.span_ids)


@router.post(
    "/traces",
    response_class=Response,
    responses={
        200: {
            "description": "ExportTraceServiceResponse; partial_success counts the rejected spans",
            "content": {"application/x-protobuf": {}, "application/json": {}},
        },
        **ERROR_RESPONSES,
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": {"type": "object"}},
            },
        }
    },
)
async def export_traces(request: Request, state: StateDep, identity: IngestIdentity) -> Response:
    """OTLP/HTTP ExportTraceServiceRequest (protobuf or JSON, gzip/deflate); llm_request spans become requests."""
    media = request_media(request)
    async with state.admission.admit() as ticket:
        raw = await read_body(request, ticket, state.settings.max_batch_bytes)
        state.metrics.bytes.inc(len(raw))
        body = await decode_body(request, raw, state, ticket)
        spans, batch = await run_in_threadpool(decode_export, state, body, media)
        result = None
        if batch is not None:  # stored as a push is, in the round of the pushes queued with it
            ticket.reserve_rows(batch.count)
            push = Push(
                spans.identity,
                spans.idempotency_key,
                Claims(identity, state.windows),
                max_events=state.settings.otlp_max_spans,
                parsed=batch,
            )
            result = await state.admission.store(request, push, round_store(state), group=True, size=len(body))
    _count(state.metrics, spans, result)
    if spans.rejected or spans.repeated:
        log.info("OTLP export: %s", spans.error_message())
    return Response(otlp.export_response(spans, media), media_type=MEDIA_TYPES[media])


def _count(metrics: IngestMetrics, spans: otlp.SpanBatch, result: IngestResult | None) -> None:
    stored = 0
    if result is not None:
        metrics.batches.labels("duplicate" if result.duplicate else "accepted").inc()
        stored = 0 if result.duplicate else result.counts.get("request", 0)
        metrics.events.labels("request").inc(stored)
    metrics.otlp_spans.labels("stored").inc(stored)
    metrics.otlp_spans.labels("duplicate").inc(len(spans.events) - stored + spans.repeated)
    metrics.otlp_spans.labels("ignored").inc(spans.ignored)
    metrics.otlp_spans.labels("rejected").inc(spans.rejected)
