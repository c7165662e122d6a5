"""OTLP traces -> request rows: vLLM's `llm_request` span becomes a request event like kvpilot's own engine's.

The source adapter for vLLM's OpenTelemetry spans (docs/architecture.md: a request row has one shape whatever its
source). vLLM (v1 `OutputProcessor.do_tracing`) exports one SERVER span named `llm_request` per finished
request: it starts at the request's arrival and carries the stages as `gen_ai.latency.*` attributes. Each
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

The stage before the engine: vLLM's span starts at its renderer's `arrival_time`, after the API server
has read the HTTP request. `kvpilot vllm serve` stamps the HTTP arrival on the trace context
(`integrations/vllm/asgi/kvpilot_arrival.py`), and the span carries it back in its tracestate as
`kvpilot=t<epoch microseconds>`: `frontend_s` is the span's start minus that stamp. Without a stamp (vLLM
started some other way), or with one that cannot be this span's (after its start, or more than
`MAX_FRONTEND_S` before it), `frontend_s` stays None: not measured, never guessed.

TTFT to the first bytes served: `kvpilot vllm serve`'s middleware also writes, on a streamed request's span,
when its first bytes went to the HTTP server (`kvpilot.first_byte_time`, epoch seconds). vLLM stamps its
first token earlier, when its output loop takes it from the engine; so `ttft_s` becomes the time from vLLM's
arrival to those bytes (never less than vLLM's own figure, at most `MAX_FRONTEND_S` more), and `e2e_s` is
at least that. Without the attribute, `ttft_s` is vLLM's `time_to_first_token`.

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

Media = Literal["protobuf", "json"]

LLM_REQUEST = "llm_request"
DEFAULT_RUN_ID = "otlp"
RUN_ID_ATTRIBUTE = "kvpilot.run_id"
REQUEST_ID = "gen_ai.request.id"
# RequestEvent field <- vLLM's attribute (vllm/tracing/utils.py SpanAttributes). time_in_model_inference
# is prefill + decode, so it is not stored; the sampling parameters are not part of a request row.
REQUIRED_SECONDS = {
    "queue_s": "gen_ai.latency.time_in_queue",
    "prefill_s": "gen_ai.latency.time_in_model_prefill",
    "decode_s": "gen_ai.latency.time_in_model_decode",
    "e2e_s": "gen_ai.latency.e2e",
}
OPTIONAL_SECONDS = {"ttft_s": "gen_ai.latency.time_to_first_token"}
REQUIRED_COUNTS = {"prompt_tokens": "gen_ai.usage.prompt_tokens", "output_tokens": "gen_ai.usage.completion_tokens"}
_FIELD_ATTRIBUTE = {
    **REQUIRED_SECONDS,
    **OPTIONAL_SECONDS,
    **REQUIRED_COUNTS,
    "request_id": REQUEST_ID,
    "instance": "the instance (from the resource attributes)",
    "run_id": RUN_ID_ATTRIBUTE,
    "ts": "the span's start time plus gen_ai.latency.e2e",
    "frontend_s": "tracestate kvpilot (the HTTP arrival)",
}
ARRIVAL_STAMP_KEY = "kvpilot"
FIRST_BYTE = "kvpilot.first_byte_time"
MAX_FRONTEND_S = 3600.0
CLOCK_SLACK_S = 0.001  # the stamp and vLLM's arrival_time read one clock, rounded to the microsecond
_WANTED = {*REQUIRED_SECONDS.values(), *OPTIONAL_SECONDS.values(), *REQUIRED_COUNTS.values(), REQUEST_ID, FIRST_BYTE}
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
                _keep_attributes(span, _WANTED)
                for unread in ("parentSpanId", "parent_span_id", "events", "links"):
                    span.pop(unread, None)


def _keep_attributes(obj: dict, wanted: set[str]) -> None:
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
                except _SpanRejected as exc:
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


class _SpanRejected(ValueError):
    """Why one llm_request span cannot be a request row; the text names attributes, never values."""


def _span_event(
    span: Span, instance: str, run_id: str, window: TimeWindow | None
) -> tuple[tuple[str, str], dict[str, Any]]:
    trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
    if len(trace_id) != 32 or len(span_id) != 16 or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        raise _SpanRejected("invalid trace_id or span_id")
    if span.start_time_unix_nano == 0:
        raise _SpanRejected("no start time (the request's arrival)")
    attrs = {kv.key: kv.value for kv in span.attributes if kv.key in _WANTED}
    event: dict[str, Any] = {"type": "request", "instance": instance, "run_id": run_id, "status": "finished"}
    for name, key in REQUIRED_SECONDS.items():
        event[name] = _number(attrs, key, required=True)
    for name, key in OPTIONAL_SECONDS.items():
        event[name] = _number(attrs, key, required=False)
    for name, key in REQUIRED_COUNTS.items():
        event[name] = _count(attrs, key)
    request_id = attrs.get(REQUEST_ID)
    if request_id is None or request_id.WhichOneof("value") != "string_value":
        raise _SpanRejected(f"{REQUEST_ID} missing or not a string")
    event["request_id"] = request_id.string_value
    start = span.start_time_unix_nano / 1e9
    event["frontend_s"] = frontend_seconds(span.trace_state, start)
    first_byte = _number(attrs, FIRST_BYTE, required=False)
    if first_byte is not None:
        served = first_byte - start
        engine_ttft = event["ttft_s"] if event["ttft_s"] is not None else 0.0
        if -CLOCK_SLACK_S <= served - engine_ttft <= MAX_FRONTEND_S:
            event["ttft_s"] = max(served, engine_ttft)
            event["e2e_s"] = max(event["e2e_s"], event["ttft_s"])
    # the wall-clock time of the final stage, as kvpilot's engine stamps its request events
    event["ts"] = start + event["e2e_s"]
    if any(isinstance(value, str) and "\x00" in value for value in event.values()):
        raise _SpanRejected("NUL characters are not allowed in strings")
    try:
        event = validate_event(event)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = str(err["loc"][-1]) if err["loc"] else ""
        raise _SpanRejected(f"{_FIELD_ATTRIBUTE.get(loc, loc)}: {err['msg']}") from None
    if window is not None and event["ts"] not in window:
        raise _SpanRejected(f"{_FIELD_ATTRIBUTE['ts']}: {window.message()}")
    return (trace_id, span_id), event


def frontend_seconds(trace_state: str, engine_arrival: float) -> float | None:
    """Seconds from kvpilot's HTTP arrival stamp in `trace_state` to vLLM's own arrival; None without one."""
    for member in trace_state.split(","):
        key, _, value = member.strip().partition("=")
        if key != ARRIVAL_STAMP_KEY:
            continue
        if not (value.startswith("t") and value[1:].isdigit() and len(value) <= 20):
            return None
        seconds = engine_arrival - int(value[1:]) / 1e6
        return max(0.0, seconds) if -CLOCK_SLACK_S <= seconds <= MAX_FRONTEND_S else None
    return None


def _number(attrs: dict[str, AnyValue], key: str, *, required: bool) -> float | None:
    value = attrs.get(key)
    kind = None if value is None else value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value  # type: ignore[union-attr]
    if kind == "int_value":
        return float(value.int_value)  # type: ignore[union-attr]
    if value is None and not required:
        return None
    raise _SpanRejected(f"{key} missing or not a number")


def _count(attrs: dict[str, AnyValue], key: str) -> int:
    value = attrs.get(key)
    kind = None if value is None else value.WhichOneof("value")
    if kind == "int_value":
        return value.int_value  # type: ignore[union-attr]
    if kind == "double_value" and value.double_value.is_integer():  # type: ignore[union-attr]
        return int(value.double_value)  # type: ignore[union-attr]
    raise _SpanRejected(f"{key} missing or not an integer")


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
