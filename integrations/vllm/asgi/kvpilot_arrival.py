"""ASGI middleware `kvpilot vllm serve` puts in front of vLLM's API server: the HTTP arrival, on the trace.

vLLM stamps a request's `arrival_time` in its renderer, after the API server has read and validated the
HTTP request — and under a burst its single event loop may take a large part of a second to get there. The
`llm_request` span starts at that stamp, so its TTFT and e2e leave the wait out. This middleware runs
first (vLLM adds `--middleware` classes outermost) and stamps the request's arrival on its W3C trace
context: `tracestate: kvpilot=t<epoch microseconds>`, plus a fresh sampled `traceparent` when the client
sent none (or an invalid one). vLLM copies the trace headers into the engine and makes `llm_request` a
child of that context, and OpenTelemetry's SDK carries the parent's tracestate onto the child, so the
stamp comes back on the span itself: the collector's OTLP adapter (`collector.otlp`) stores
`span start - stamp` as the request's `frontend_s`. A `kvpilot` entry the client sent is replaced, never
trusted.

The other end of TTFT: vLLM stamps the first token when its output loop takes it from the engine, and under a
burst the API server may need tens of milliseconds more to detokenize it and hand the chunk to the server. For
a streamed response the middleware notes when the first body bytes went to the server, by trace id, and an
OpenTelemetry span processor it adds to vLLM's tracer provider writes that time onto the request's
`llm_request` span as it starts (`kvpilot.first_byte_time`, epoch seconds): vLLM makes the span when the
request finishes, after its first bytes were sent. The collector then counts TTFT to those bytes.

It runs inside vLLM's interpreter, so it imports nothing but the standard library (the launcher puts this
directory on vLLM's PYTHONPATH).
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY = "kvpilot"
MAX_ENTRIES = 32  # W3C trace-context: at most 32 list members
FIRST_BYTE_ATTRIBUTE = "kvpilot.first_byte_time"
SPAN_NAME = "llm_request"
MAX_PENDING = 10_000  # first-byte times waiting for their span; the oldest go first past it
_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_MEMBER = re.compile(
    rb"^[a-z0-9][a-z0-9_\-*/@]{0,255}=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$"
)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


_first_bytes: OrderedDict[int, float] = OrderedDict()  # trace id -> when its first streamed bytes were sent
_processor_added = False


class ArrivalStamp:
    """Stamp every HTTP request's arrival on its trace context before vLLM's own handlers see it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = stamped_headers(list(scope.get("headers") or []), time.time())
        traceparent = next(value for name, value in headers if name == b"traceparent")
        _add_processor()
        await self.app({**scope, "headers": headers}, receive, _first_byte_send(send, int(traceparent[3:35], 16)))


def _first_byte_send(send: Any, trace_id: int) -> Any:
    """`send`, noting when a streamed (text/event-stream) response hands its first body bytes to the server."""
    streaming = False
    noted = False

    async def wrapped(message: MutableMapping[str, Any]) -> None:
        nonlocal streaming, noted
        kind = message.get("type")
        if kind == "http.response.start":
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            streaming = content_type.startswith(b"text/event-stream")
        elif kind == "http.response.body" and streaming and not noted and message.get("body"):
            noted = True
            _first_bytes[trace_id] = time.time()
            while len(_first_bytes) > MAX_PENDING:
                _first_bytes.popitem(last=False)
        await send(message)

    return wrapped


def _add_processor() -> None:
    """Add the first-byte span processor to vLLM's tracer provider once it has one (OpenTelemetry's SDK)."""
    global _processor_added
    if _processor_added:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanProcessor
    except ImportError:
        _processor_added = True  # no OpenTelemetry SDK: vLLM exports no spans either
        return
    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):
        return  # vLLM has not set its provider yet

    class FirstByteProcessor(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if span.name == SPAN_NAME:
                sent = _first_bytes.pop(span.get_span_context().trace_id, None)
                if sent is not None:
                    span.set_attribute(FIRST_BYTE_ATTRIBUTE, sent)

    provider.add_span_processor(FirstByteProcessor())
    _processor_added = True


def stamped_headers(headers: list[tuple[bytes, bytes]], now: float) -> list[tuple[bytes, bytes]]:
    """`headers` with one valid traceparent and a tracestate that starts with kvpilot's arrival stamp."""
    traceparent = None
    members: list[bytes] = []
    rest = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"traceparent":
            traceparent = value.strip().lower()
        elif lowered == b"tracestate":
            members += [m.strip() for m in value.split(b",") if m.strip()]
        else:
            rest.append((name, value))
    if traceparent is None or not _valid_traceparent(traceparent):
        traceparent = b"00-" + os.urandom(16).hex().encode() + b"-" + os.urandom(8).hex().encode() + b"-01"
        members = []  # a tracestate without its traceparent means nothing
    # OpenTelemetry drops a whole tracestate with one malformed member: keep the well-formed ones only
    kept = [m for m in members if _MEMBER.match(m) and not m.startswith(KEY.encode() + b"=")]
    stamp = f"{KEY}=t{int(now * 1_000_000)}".encode()
    tracestate = b",".join([stamp, *kept[: MAX_ENTRIES - 1]])
    return [*rest, (b"traceparent", traceparent), (b"tracestate", tracestate)]


def _valid_traceparent(value: bytes) -> bool:
    match = _TRACEPARENT.match(value)
    if match is None or value.startswith(b"ff"):
        return False
    return set(match[1]) != {48} and set(match[2]) != {48}  # trace and span ids of all zeros are invalid
