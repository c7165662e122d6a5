"""Benchmark-only ASGI middleware for vLLM's API server: when it took each request and wrote its first and last token.

`benchmarks.user_latency --decompose` runs vLLM with `--middleware kvpilot_bench_timing.ResponseTimes` (this
directory on its PYTHONPATH) and `BENCH_TIMING_ENV` set (not a `KVPILOT_` name: the launcher keeps those from
vLLM): one JSON line per HTTP request, wall-clock
seconds, keyed by the client's `X-Request-Id`: `entry` (the ASGI app called), `first` (the first body chunk
with completion text handed to the server), `last` (the final chunk). On one host the client's and vLLM's
wall clocks are the same clock, so the benchmark can split the client's TTFT into where it was spent.
Standard library only: it runs inside vLLM's interpreter.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import MutableMapping
from typing import Any

BENCH_TIMING_ENV = "KVBENCH_TIMING_FILE"
TEXT = b'"text":"'
EMPTY_TEXT = b'"text":""'


class ResponseTimes:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.path = os.environ[BENCH_TIMING_ENV]

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        entry = time.time()
        request_id = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        first: float | None = None

        async def timed_send(message: MutableMapping[str, Any]) -> None:
            nonlocal first
            await send(message)
            if message.get("type") != "http.response.body":
                return
            body = message.get("body") or b""
            if first is None and TEXT in body and body.count(TEXT) > body.count(EMPTY_TEXT):
                first = time.time()
            if not message.get("more_body"):
                line = {"id": request_id, "entry": entry, "first": first, "last": time.time()}
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(line) + "\n")

        await self.app(scope, receive, timed_send)
