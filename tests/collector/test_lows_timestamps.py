"""Event times are bounded at the push boundary: within the raw retention back, the clock skew ahead.

An event stamped 1970 or 1e308 was stored before, and a run stamped 1e308 sorted first in every
"latest" list forever. Both pushes (/v1/ingest, on the msgspec and the pydantic path) and OTLP spans
(/v1/traces, one span rejected in partial_success) are checked here against a collector with the
default retention (7 days) and skew (5 minutes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sqlalchemy import func, select

from collector.db import make_engine
from collector.schema import RequestRow, Run, StepRow
from collector.server import create_app
from collector.settings import CollectorSettings
from collector.validation import TimeWindow
from tests.collector import evfactory as ev

TOKEN = "lows-ts"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DAY = 86_400.0


@pytest.fixture
def settings(sqlite_url: str) -> CollectorSettings:
    return CollectorSettings(db_url=sqlite_url, ingest_token=TOKEN, scrape_enabled=False)


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def stored(settings: CollectorSettings, model: type) -> int:
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()
    engine.dispose()
    return n


def push(client: TestClient, body: bytes):
    return client.post("/v1/ingest", content=body, headers={**AUTH, "Content-Type": "application/json"})


def test_defaults_are_the_raw_retention_and_five_minutes() -> None:
    window = TimeWindow.for_settings(CollectorSettings(), now=1_000_000_000.0)
    assert (window.earliest, window.latest) == (1_000_000_000.0 - 7 * DAY, 1_000_000_000.0 + 300.0)
    assert "2001-09-02T01:46:40+00:00" in window.message()
    assert "epoch seconds" in TimeWindow(-1e18, 1e18).message()  # bounds past what a datetime holds


@pytest.mark.parametrize(
    ("offset", "accepted"),
    [
        (0.0, True),
        (-6.5 * DAY, True),
        (240.0, True),  # a clock a little ahead is within the skew
        (-7.5 * DAY, False),  # older than the raw retention: the next prune would drop it
        (600.0, False),  # ten minutes ahead: a broken clock
    ],
)
def test_times_around_now(client: TestClient, settings: CollectorSettings, offset: float, accepted: bool) -> None:
    now = time.time()
    answer = push(client, ev.body([ev.step(0, ts=now), ev.step(1, ts=now + offset)]))
    if accepted:
        assert answer.status_code == 202, answer.text
        assert stored(settings, StepRow) == 2
    else:
        assert answer.status_code == 422
        error = answer.json()["errors"][0]
        assert error["loc"] == "events[1].ts" and "retention" in error["msg"]
        assert stored(settings, StepRow) == 0


@pytest.mark.parametrize("ts", [1.0, 1e308])
@pytest.mark.parametrize("escaped", [False, True], ids=["msgspec", "pydantic"])
def test_1970_and_1e308_are_refused_naming_the_event(
    client: TestClient, settings: CollectorSettings, ts: float, escaped: bool
) -> None:
    now = time.time()
    # \u escapes send a body down the pydantic path; both paths must bound the time alike
    run = "r\\u0031" if escaped else "r1"
    events = [ev.request(i, ts=now, run_id="RUN") for i in range(3)] + [ev.request(3, ts=ts, run_id="RUN")]
    body = ev.body(events).replace(b'"RUN"', f'"{run}"'.encode())
    answer = push(client, body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["loc"] == "events[3].ts"
    assert str(ts) not in answer.text  # the bounds, not the value, are echoed
    assert stored(settings, RequestRow) == 0 and stored(settings, Run) == 0


def _span(i: int, start_s: float) -> Span:
    attrs = {
        "gen_ai.latency.time_in_queue": 0.01,
        "gen_ai.latency.time_in_model_prefill": 0.02,
        "gen_ai.latency.time_in_model_decode": 0.5,
        "gen_ai.latency.e2e": 0.55,
    }
    span = Span(
        trace_id=bytes([i + 1]) * 16,
        span_id=bytes([i + 1]) * 8,
        name="llm_request",
        start_time_unix_nano=int(start_s * 1e9),
        end_time_unix_nano=int(start_s * 1e9) + 10**9,
    )
    span.attributes.extend(KeyValue(key=k, value=AnyValue(double_value=v)) for k, v in attrs.items())
    span.attributes.extend(
        [
            KeyValue(key="gen_ai.usage.prompt_tokens", value=AnyValue(int_value=10)),
            KeyValue(key="gen_ai.usage.completion_tokens", value=AnyValue(int_value=5)),
            KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=f"req-{i}")),
        ]
    )
    return span


def test_an_otlp_span_out_of_the_window_is_rejected_alone(client: TestClient, settings: CollectorSettings) -> None:
    now = time.time()
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.extend([_span(0, now - 60), _span(1, 1.0), _span(2, now + 3600), _span(3, now - 30)])
    answer = client.post(
        "/v1/traces",
        content=request.SerializeToString(),
        headers={**AUTH, "Content-Type": "application/x-protobuf"},
    )
    assert answer.status_code == 200, answer.text
    response = ExportTraceServiceResponse.FromString(answer.content)
    assert response.partial_success.rejected_spans == 2
    assert "span 1: the span's start time plus gen_ai.latency.e2e: must be within" in (
        response.partial_success.error_message
    )
    assert stored(settings, RequestRow) == 2


def test_skew_is_configurable(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_MAX_CLOCK_SKEW_S", "3600")
    settings = CollectorSettings(db_url=sqlite_url, ingest_token=TOKEN, scrape_enabled=False)
    with TestClient(create_app(settings)) as client:
        assert push(client, ev.body([ev.step(0, ts=time.time() + 1800)])).status_code == 202
