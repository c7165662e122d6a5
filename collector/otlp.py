"""OTLP traces -> request rows: vLLM's `llm_request` span becomes a request event like kvpilot's own engine's.

The source adapter for vLLM's OpenTelemetry spans (docs/architecture.md: a request row has one shape whatever its
source). The export is decoded here; which attribute holds which stage, and the stamps `kvpilot vllm serve`
adds (the HTTP arrival, the first bytes served), are vLLM's side (`integrations.vllm.spans`). Each span
becomes a `request` event validated exactly like a pushed one (`collector.validation.validate_event`), and
the batch is stored by `collector.ingest.store_batch`: same transaction, idempotency and instance/run upserts,
so every reader sees vLLM's requests as it sees kvpilot's.

Instance, from the span's resource attributes, first match wins:
1. `KVPILOT_OTLP_INSTANCE_MAP[service.name]` (the operator's choice);
2. `service.instance.id`. The OpenTelemetry Python SDK sets a random UUID per process unless
   OTEL_RESOURCE_ATTRIBUTES names one: set it (or map the service) for an instance that survives restarts;
3. `service.name@host.name`, else `service.name@host.id`;
4. `service.name`, else OpenTelemetry's own default `unknown_service`.
Run id: the `kvpilot.run_id` resource attribute, else "otlp".

Dedup: the batch's idempotency key hashes its spans' identities (trace_id, span_id), not its bytes, so a
retried export is found whatever its encoding or compression; and `store_batch` claims each span in
`otlp_spans`, so a span re-sent inside another export is not stored twice either.

Spans of other names are counted and ignored. An `llm_request` span that cannot be a request row (a
required attribute missing, of the wrong type or out of range) is rejected alone and reported in the
response's partial success by its position and the attribute's name, never by anything it contains; so is
one whose ids are not hex (OTLP/JSON), and a span repeated inside one export is dropped and counted there.
An export is measured before it is decoded (`collector.otlpscan`): past `otlp_max_spans` spans, or more
messages or JSON values than they may hold, it is refused whole (413).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any, Literal

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span
from pydantic import ValidationError

from collector import otlpscan
from collector.errors import CollectorError
from collector.validation import TimeWindow, validate_event
from integrations.vllm.spans import FIELD_SOURCE, LLM_REQUEST, SPAN_ATTRIBUTES, SpanRejected, request_fields

Media = Literal["protobuf", "json"]

DEFAULT_RUN_ID = "otlp"
RUN_ID_ATTRIBUTE = "kvpilot.run_id"
_FIELD_ATTRIBUTE = {
    **FIELD_SOURCE,
    "instance": "the instance (from the resource attributes)",
    "run_id": RUN_ID_ATTRIBUTE,
}
_RESOURCE_WANTED = {"service.name", "service.instance.id", "host.name", "host.id", RUN_ID_ATTRIBUTE}
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


class OtlpDecodeError(CollectorError):
    """The body is not an ExportTraceServiceRequest in the declared encoding (400)."""


class TooManySpansError(CollectorError):
    """More spans in one export than `otlp_max_spans` (413)."""


@dataclass
class SpanBatch:
    """What one export request holds for the collector: request events, and the count of everything else."""

    events: list[dict[str, Any]] = field(default_factory=list)
    span_ids: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id) per event, hex
    ignored: int = 0  # spans of other names
    rejected: int = 0  # llm_request spans that cannot be request rows
    repeated: int = 0  # the same span twice in this request
    first_error: str | None = None

    @property
    def identity(self) -> bytes:
        """The sorted span identities: what makes two exports the same export."""
        return "\n".join(sorted(t + s for t, s in self.span_ids)).encode()

    @property
    def idempotency_key(self) -> str:
        return "otlp-" + hashlib.sha256(self.identity).hexdigest()

    def error_message(self) -> str:
        parts = [f"{self.rejected} llm_request span(s) rejected; first: {self.first_error}"] if self.rejected else []
        if self.repeated:
            parts.append(f"{self.repeated} span(s) repeated a (trace_id, span_id) of this export and were dropped")
        return "; ".join(parts)


# --- decoding ----------------------------------------------------------------------------------------


def parse_request(body: bytes, media: Media, *, max_spans: int) -> ExportTraceServiceRequest:
    """Decode an export request with the OTLP protocol package; OtlpDecodeError if it is not one,
    TooManySpansError past `max_spans` spans or what they may hold (`otlpscan`: counted before decoding)."""
    if media == "protobuf":
        try:
            otlpscan.count_protobuf(body, max_spans=max_spans)
        except otlpscan.MalformedError as exc:
            raise OtlpDecodeError("body is not a protobuf ExportTraceServiceRequest") from exc
        except otlpscan.ExportBoundError as exc:
            raise TooManySpansError(str(exc)) from None
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except (DecodeError, RecursionError) as exc:
            raise OtlpDecodeError("body is not a protobuf ExportTraceServiceRequest") from exc
        return request
    try:
        otlpscan.check_json_size(body, max_spans=max_spans)
    except otlpscan.ExportBoundError as exc:
        raise TooManySpansError(str(exc)) from None
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        spans = otlpscan.count_json_spans(data, _items)
        if spans > max_spans:
            raise TooManySpansError(f"export has {spans} spans; the limit is {max_spans}")
        _prepare_json(data)
        request = ExportTraceServiceRequest()
        json_format.ParseDict(data, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise OtlpDecodeError("body is not an OTLP/JSON ExportTraceServiceRequest") from exc
    return request


def _prepare_json(data: dict) -> None:
    """Make an OTLP/JSON export what the protobuf JSON mapping needs to map, and no more.

    The mapping is pure Python and costs microseconds per value, so only what `request_events` reads is
    left: a span of another name keeps only its name (it is counted as ignored), an llm_request span its
    ids (hex in OTLP/JSON, base64 in the mapping), start time and the attributes read (the last of each
    key, as the conversion reads them), and a resource only the attributes that name its instance.
    """
    for resource_spans in _items(data, "resourceSpans", "resource_spans"):
        resource = resource_spans.get("resource")
        if isinstance(resource, dict):
            _keep_attributes(resource, _RESOURCE_WANTED)
        for scope_spans in _items(resource_spans, "scopeSpans", "scope_spans"):
            spans = _items(scope_spans, "spans")
            for i, span in enumerate(spans):
                if not isinstance(span, dict):
                    continue  # the mapping refuses it: 400
                if span.get("name") != LLM_REQUEST:
                    if isinstance(span.get("name", ""), str):
                        spans[i] = {"name": span.get("name", "")}
                    continue
                _convert_ids(span, ("traceId", "trace_id", "spanId", "span_id"))
                _keep_attributes(span, SPAN_ATTRIBUTES)
                for unread in ("parentSpanId", "parent_span_id", "events", "links"):
                    span.pop(unread, None)


def _keep_attributes(obj: dict, wanted: Set[str]) -> None:
    attributes = obj.get("attributes")
    if isinstance(attributes, list):
        kept = {kv["key"]: kv for kv in attributes if isinstance(kv, dict) and kv.get("key") in wanted}
        obj["attributes"] = list(kept.values())


def _items(obj: Any, *names: str) -> list:
    if not isinstance(obj, dict):
        return []
    for name in names:
        value = obj.get(name)
        if isinstance(value, list):
            return value
    return []


def _convert_ids(obj: Any, names: tuple[str, ...]) -> None:
    """An id that is not a hex string becomes empty: that span alone is rejected (an llm_request span
    needs both ids), not the whole export."""
    if not isinstance(obj, dict):
        return
    for name in names:
        if name not in obj:
            continue
        value = obj[name]
        try:
            obj[name] = base64.b64encode(bytes.fromhex(value)).decode() if isinstance(value, str) else ""
        except ValueError:
            obj[name] = ""


# --- spans -> request events -------------------------------------------------------------------------


def request_events(
    request: ExportTraceServiceRequest,
    *,
    instance_map: dict[str, str],
    max_spans: int,
    window: TimeWindow | None = None,
) -> SpanBatch:
    """The request events of vLLM's `llm_request` spans in `request`; other spans are only counted.

    `window`, given for pushes, rejects a span whose request ended outside it."""
    total = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
    if total > max_spans:
        raise TooManySpansError(f"export has {total} spans; the limit is {max_spans}")
    out = SpanBatch()
    seen: set[tuple[str, str]] = set()
    position = -1
    for resource_spans in request.resource_spans:
        instance, run_id = resource_identity(resource_spans, instance_map)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                position += 1
                if span.name != LLM_REQUEST:
                    out.ignored += 1
                    continue
                try:
                    span_id, event = _span_event(span, instance, run_id, window)
                except SpanRejected as exc:
                    out.rejected += 1
                    out.first_error = out.first_error or f"span {position}: {exc}"
                    continue
                if span_id in seen:
                    out.repeated += 1
                    continue
                seen.add(span_id)
                out.span_ids.append(span_id)
                out.events.append(event)
    return out


def resource_identity(resource_spans: ResourceSpans, instance_map: dict[str, str]) -> tuple[str, str]:
    """(instance, run id) of the spans of one resource; the order is in the module's docstring."""
    attrs = {
        kv.key: kv.value.string_value
        for kv in resource_spans.resource.attributes
        if kv.key in _RESOURCE_WANTED and kv.value.WhichOneof("value") == "string_value" and kv.value.string_value
    }
    service = attrs.get("service.name")
    host = attrs.get("host.name") or attrs.get("host.id")
    if service is not None and service in instance_map:
        instance = instance_map[service]
    elif "service.instance.id" in attrs:
        instance = attrs["service.instance.id"]
    elif service is not None and host is not None:
        instance = f"{service}@{host}"
    else:
        instance = service or "unknown_service"
    return instance, attrs.get(RUN_ID_ATTRIBUTE, DEFAULT_RUN_ID)


def _span_event(
    span: Span, instance: str, run_id: str, window: TimeWindow | None
) -> tuple[tuple[str, str], dict[str, Any]]:
    trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
    if len(trace_id) != 32 or len(span_id) != 16 or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        raise SpanRejected("invalid trace_id or span_id")
    if span.start_time_unix_nano == 0:
        raise SpanRejected("no start time (the request's arrival)")
    attrs = {kv.key: _plain(kv.value) for kv in span.attributes if kv.key in SPAN_ATTRIBUTES}
    event: dict[str, Any] = {"type": "request", "instance": instance, "run_id": run_id, "status": "finished"}
    event |= request_fields(attrs, start=span.start_time_unix_nano / 1e9, trace_state=span.trace_state)
    if any(isinstance(value, str) and "\x00" in value for value in event.values()):
        raise SpanRejected("NUL characters are not allowed in strings")
    try:
        event = validate_event(event)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = str(err["loc"][-1]) if err["loc"] else ""
        raise SpanRejected(f"{_FIELD_ATTRIBUTE.get(loc, loc)}: {err['msg']}") from None
    if window is not None and event["ts"] not in window:
        raise SpanRejected(f"{_FIELD_ATTRIBUTE['ts']}: {window.message()}")
    return (trace_id, span_id), event


def _plain(value: AnyValue) -> Any:
    """An attribute's value as Python: str, int, float or bool; another kind (array, bytes, kvlist, none) stays
    the protobuf value, which no field accepts."""
    kind = value.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return value


# --- answers -----------------------------------------------------------------------------------------


def export_response(batch: SpanBatch | None, media: Media) -> bytes:
    """ExportTraceServiceResponse, with partial_success when spans were rejected (OTLP/HTTP spec)."""
    response = ExportTraceServiceResponse()
    if batch is not None and (batch.rejected or batch.repeated):
        response.partial_success.rejected_spans = batch.rejected + batch.repeated
        response.partial_success.error_message = batch.error_message()
    return _encode(response, media)


# HTTP status -> google.rpc.Code, for the Status body of a refusal
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 413: 8, 415: 3, 422: 3, 429: 8, 503: 14}


def status_body(status_code: int, message: str, media: Media) -> bytes:
    """The google.rpc.Status body the OTLP/HTTP spec gives every 4xx/5xx answer."""
    return _encode(Status(code=_GRPC_CODES.get(status_code, 2), message=message), media)


def _encode(message: Any, media: Media) -> bytes:
    if media == "json":
        return json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
    return message.SerializeToString()
