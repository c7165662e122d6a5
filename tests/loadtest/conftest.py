"""Fixtures for the load tester: a fake engine (no torch) for fast client/analysis tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from plumbing.serving import serve_in_thread

FAKE_METRICS = """# TYPE kvpilot_utilization gauge
kvpilot_utilization {util}
# TYPE kvpilot_oom counter
kvpilot_oom_total {oom}
# TYPE kvpilot_step_duration_seconds histogram
kvpilot_step_duration_seconds_count {steps}
kvpilot_step_duration_seconds_sum 1.0
"""


def fake_engine_app(state: dict) -> FastAPI:
    """/generate whose behaviour is chosen by the prompt's length: 429, 500, hang, or a normal stream."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        state["requests"] += 1
        behaviour = state["behaviour"](body)
        if behaviour == "429":
            return JSONResponse({"detail": "queue full"}, status_code=429, headers={"Retry-After": "1"})
        if behaviour == "500":
            return JSONResponse({"detail": "boom"}, status_code=500)
        if behaviour == "hang":
            await asyncio.sleep(4)

        async def events():
            for i in range(body["max_tokens"]):
                yield f"data: {json.dumps({'request_id': body['request_id'], 'text': 'x', 'token_ids': [i]})}\n\n"
                await asyncio.sleep(0.001)
            if behaviour == "cut":
                return
            final = {
                "request_id": body["request_id"],
                "output_tokens": body["max_tokens"],
                "finished": True,
                "timings": {
                    "queue_s": 0.0,
                    "prefill_s": 0.001,
                    "ttft_s": 0.001,
                    "decode_s": 0.01,
                    "e2e_s": 0.011,
                    "preemptions": 0,
                    "swaps": 0,
                },
            }
            yield f"data: {json.dumps(final)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        state["steps"] += 10
        return PlainTextResponse(FAKE_METRICS.format(util=state["util"](), oom=state["oom"], steps=state["steps"]))

    return app


@pytest.fixture
def fake_engine() -> Iterator[tuple[str, dict]]:
    state: dict = {"requests": 0, "steps": 0, "oom": 0, "behaviour": lambda body: "ok", "util": lambda: 0.8}
    with serve_in_thread(fake_engine_app(state), name="fake-engine", lifespan="off", timeout_s=10.0) as server:
        yield server.url, state
