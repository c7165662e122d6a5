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

It runs inside vLLM's interpreter, so it imports nothing but the standard library (the launcher puts this
directory on vLLM's PYTHONPATH).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY = "kvpilot"
MAX_ENTRIES = 32  # W3C trace-context: at most 32 list members
_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_MEMBER = re.compile(
    rb"^[a-z0-9][a-z0-9_\-*/@]{0,255}=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$"
)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class ArrivalStamp:
    """Stamp every HTTP request's arrival on its trace context before vLLM's own handlers see it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            scope = {**scope, "headers": stamped_headers(list(scope.get("headers") or []), time.time())}
        await self.app(scope, receive, send)


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
    return bool(match) and not value.startswith(b"ff") and set(match[1]) != {48} and set(match[2]) != {48}
