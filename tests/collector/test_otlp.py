"""POST /v1/traces with payloads the real OpenTelemetry SDK encodes: vLLM's llm_request spans become request rows.

Spans are built with opentelemetry-sdk under vLLM's exact attribute names (vllm/v1/engine/output_processor.py
`do_tracing`) and encoded with the exporter's own encoder (`encode_spans`); the last test runs the real
OTLPSpanExporter (http/protobuf, gzip, token from OTEL_EXPORTER_OTLP_TRACES_HEADERS) against a served
collector. Every storage test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from sqlalchemy import func, select

from collector import otlp
from collector.db import make_engine
from collector.errors import StorageUnavailableError
from collector.ingest import batch_from_events, store_batch
from collector.queries import latency_percentiles
from collector.retention import DAY, prune
from collector.schema import IngestBatch, Instance, OtlpSpan, RequestRow, Run
from collector.server import create_app, ingest_routes, run_in_thread
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
T0 = 1_790_000_000.0
VLLM = {"service.name": "vllm", "service.instance.id": "vllm-h200-0", "kvpilot.run_id": "bench-7"}


@pytest.fixture
def settings(db_url: str) -> CollectorSettings:
    return CollectorSettings(
        db_url=db_url,
        ingest_token=TOKEN,
        scrape_enabled=False,
        max_batch_bytes=64 * 1024,
        max_decompressed_bytes=256 * 1024,
        otlp_max_spans=50,
        otlp_instance_map={"mapped-vllm": "vllm-a100-1"},
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


# --- spans as vLLM makes them --------------------------------------------------------------------------


def vllm_attributes(i: int) -> dict[str, Any]:
    """`do_tracing`'s attributes for request i: queue, prefill, decode and a small arrival->queued gap."""
    queue, prefill, decode = 0.01 * (i + 1), 0.02 + 0.001 * i, 0.5 + 0.01 * i
    gap = 0.002
    return {
        "gen_ai.latency.time_to_first_token": gap + queue + prefill,
        "gen_ai.latency.e2e": gap + queue + prefill + decode,
        "gen_ai.latency.time_in_queue": queue,
        "gen_ai.usage.prompt_tokens": 100 + i,
        "gen_ai.usage.completion_tokens": 20 + i,
        "gen_ai.latency.time_in_model_prefill": prefill,
        "gen_ai.latency.time_in_model_decode": decode,
        "gen_ai.latency.time_in_model_inference": prefill + decode,
        "gen_ai.request.id": f"chatcmpl-{i}",
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.n": 1,
    }


def make_spans(
    attributes: Sequence[dict[str, Any]],
    *,
    resource: dict[str, str] | None = None,
    detect: bool = True,
    others: int = 0,
    trace_headers: Sequence[dict[str, str]] | None = None,
) -> list[ReadableSpan]:
    """Finished SDK spans: one llm_request per attribute dict (start = arrival), then `others` other spans.

    `detect` builds the resource as vLLM does (`Resource.create`: the SDK adds its own attributes, among them
    a random service.instance.id unless one is given); without it the resource holds `resource` only.
    """
    attrs = VLLM if resource is None else resource
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(attrs) if detect else Resource(attrs))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("vllm.v1.engine.output_processor")
    for i, attrs in enumerate(attributes):
        arrival = int((T0 + i) * 1e9)
        # as vLLM does: the request's trace headers, extracted, are the span's parent context
        context = TraceContextTextMapPropagator().extract(trace_headers[i]) if trace_headers else None
        span = tracer.start_span("llm_request", start_time=arrival, kind=SpanKind.SERVER, context=context)
        span.set_attributes(attrs)
        span.end(end_time=arrival + 10**9)
    for j in range(others):
        with tracer.start_as_current_span("chat_completion", attributes={"secret.prompt": f"do not echo {j}"}):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def protobuf_body(spans: Sequence[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()


def json_body(spans: Sequence[ReadableSpan]) -> bytes:
    """OTLP/JSON as the spec writes it: camelCase, int64 as strings, enums as integers, hex ids."""
    data = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for resource_spans in data["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data).encode()


ENCODINGS = {
    "protobuf": (protobuf_body, PROTOBUF, lambda b: b),
    "json": (json_body, JSON, lambda b: b),
    "protobuf-gzip": (protobuf_body, {**PROTOBUF, "Content-Encoding": "gzip"}, gzip.compress),
    "json-gzip": (json_body, {**JSON, "Content-Encoding": "gzip"}, gzip.compress),
    "protobuf-deflate": (protobuf_body, {**PROTOBUF, "Content-Encoding": "deflate"}, zlib.compress),
}


def export(client: TestClient, spans: Sequence[ReadableSpan], encoding: str = "protobuf", **headers: str):
    encode, base_headers, compress = ENCODINGS[encoding]
    return client.post("/v1/traces", content=compress(encode(spans)), headers={**base_headers, **AUTH, **headers})


def export_response(resp) -> ExportTraceServiceResponse:
    message = ExportTraceServiceResponse()
    if resp.headers["content-type"].startswith("application/json"):
        json_format.Parse(resp.content, message)
    else:
        message.ParseFromString(resp.content)
    return message


def status_of(resp) -> Status:
    message = Status()
    if resp.headers["content-type"].startswith("application/json"):
        json_format.Parse(resp.content, message)
    else:
        message.ParseFromString(resp.content)
    return message


def rows(settings: CollectorSettings) -> Sequence[Any]:
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        found = conn.execute(select(RequestRow.__table__).order_by(RequestRow.request_id)).all()
    engine.dispose()
    return found


def count(settings: CollectorSettings, model: type) -> int:
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()
    engine.dispose()
    return n


def metric(client: TestClient, result: str) -> float:
    line = f'kvpilot_collector_otlp_spans_total{{result="{result}"}} '
    text = client.get("/metrics").text
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


# --- stored rows ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_llm_request_spans_become_request_rows(client: TestClient, settings: CollectorSettings, encoding: str) -> None:
    spans = make_spans([vllm_attributes(i) for i in range(3)])
    resp = export(client, spans, encoding)
    assert resp.status_code == 200, resp.content
    assert resp.headers["content-type"] == ENCODINGS[encoding][1]["Content-Type"]
    assert not export_response(resp).HasField("partial_success")
    stored = rows(settings)
    assert len(stored) == 3
    for i, row in enumerate(stored):
        attrs = vllm_attributes(i)
        assert (row.instance, row.run_id, row.request_id, row.status) == (
            "vllm-h200-0",
            "bench-7",
            f"chatcmpl-{i}",
            "finished",
        )
        assert row.queue_s == pytest.approx(attrs["gen_ai.latency.time_in_queue"])
        assert row.prefill_s == pytest.approx(attrs["gen_ai.latency.time_in_model_prefill"])
        assert row.decode_s == pytest.approx(attrs["gen_ai.latency.time_in_model_decode"])
        assert row.ttft_s == pytest.approx(attrs["gen_ai.latency.time_to_first_token"])
        assert row.e2e_s == pytest.approx(attrs["gen_ai.latency.e2e"])
        assert (row.prompt_tokens, row.output_tokens) == (100 + i, 20 + i)
        # the stages add up to end to end, less vLLM's arrival->queued gap (tokenization, 2 ms here)
        stages = row.queue_s + row.prefill_s + row.decode_s
        assert stages <= row.e2e_s and row.e2e_s - stages == pytest.approx(0.002)
        assert row.ts == pytest.approx(T0 + i + row.e2e_s)  # arrival (span start) + e2e
        assert (row.priority, row.preemptions, row.swaps, row.finish_reason, row.warmup) == (1, 0, 0, None, False)
    assert metric(client, "stored") == 3
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        assert conn.execute(select(Instance.name, Instance.first_seen_ts)).one() == ("vllm-h200-0", stored[0].ts)
        assert conn.execute(select(Run.instance, Run.run_id)).one() == ("vllm-h200-0", "bench-7")
    engine.dispose()


def test_the_http_arrival_and_first_bytes_come_back_on_the_span(
    client: TestClient, settings: CollectorSettings
) -> None:
    """The launcher's middleware stamps the headers; vLLM's span, their child, carries the stamp back."""
    from integrations.vllm.asgi.kvpilot_arrival import stamped_headers

    def headers(raw: list[tuple[bytes, bytes]], arrival: float) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in stamped_headers(raw, arrival)}

    client_trace = (b"traceparent", b"00-" + b"ab" * 16 + b"-" + b"cd" * 8 + b"-01")
    forged = (b"tracestate", b"kvpilot=t1,vendor=x")
    cases = [
        headers([(b"content-type", b"application/json")], T0 - 0.25),  # 250 ms before vLLM's arrival (T0)
        headers([client_trace, forged], T0 + 1 - 0.5),  # the client's trace kept, its kvpilot entry replaced
        {},  # no middleware: not measured
        {"traceparent": client_trace[1].decode(), "tracestate": f"kvpilot=t{int((T0 + 3 + 5) * 1e6)}"},  # after
    ]
    attrs = [vllm_attributes(i) for i in range(4)]
    ttft = [a["gen_ai.latency.time_to_first_token"] for a in attrs]
    attrs[0]["kvpilot.first_byte_time"] = T0 + ttft[0] + 0.04  # its first bytes 40 ms after vLLM's first token
    attrs[1]["kvpilot.first_byte_time"] = T0 + 1 + ttft[1] - 0.5  # before vLLM's first token: not these bytes
    spans = make_spans(attrs, trace_headers=cases)
    assert export(client, spans).status_code == 200
    stored = {row.request_id: row for row in rows(settings)}
    assert stored["chatcmpl-0"].ttft_s == pytest.approx(ttft[0] + 0.04, abs=1e-5)
    assert stored["chatcmpl-1"].ttft_s == pytest.approx(ttft[1]) and stored["chatcmpl-2"].ttft_s == pytest.approx(
        ttft[2]
    )
    assert stored["chatcmpl-0"].frontend_s == pytest.approx(0.25, abs=1e-5)
    assert stored["chatcmpl-1"].frontend_s == pytest.approx(0.5, abs=1e-5)
    assert stored["chatcmpl-2"].frontend_s is None and stored["chatcmpl-3"].frontend_s is None
    assert spans[1].context.trace_id == int("ab" * 16, 16) and "vendor=x" in cases[1]["tracestate"]


@pytest.mark.parametrize(
    ("resource", "detect", "instance", "run_id"),
    [
        (
            {"service.name": "mapped-vllm", "service.instance.id": "ignored", "kvpilot.run_id": "r"},
            True,
            "vllm-a100-1",
            "r",
        ),
        ({"service.name": "vllm", "service.instance.id": "pod-7"}, True, "pod-7", "otlp"),
        ({"service.name": "vllm", "host.name": "gpu-node-3"}, False, "vllm@gpu-node-3", "otlp"),
        ({"service.name": "vllm", "host.id": "i-0abc"}, False, "vllm@i-0abc", "otlp"),
        ({"service.name": "vllm"}, False, "vllm", "otlp"),
        ({}, False, "unknown_service", "otlp"),
    ],
    ids=["mapping", "service.instance.id", "service@host.name", "service@host.id", "service.name", "nothing"],
)
def test_instance_and_run_from_the_resource(
    client: TestClient,
    settings: CollectorSettings,
    resource: dict[str, str],
    detect: bool,
    instance: str,
    run_id: str,
) -> None:
    resp = export(client, make_spans([vllm_attributes(0)], resource=resource, detect=detect))
    assert resp.status_code == 200, resp.content
    [row] = rows(settings)
    assert (row.instance, row.run_id) == (instance, run_id)


# --- dedup ---------------------------------------------------------------------------------------------


def test_retried_export_is_stored_once_in_any_encoding(client: TestClient, settings: CollectorSettings) -> None:
    spans = make_spans([vllm_attributes(i) for i in range(4)])
    for encoding in ENCODINGS:
        assert export(client, spans, encoding).status_code == 200
    # the same spans in another order are the same export
    assert export(client, list(reversed(spans)), "json").status_code == 200
    assert len(rows(settings)) == 4
    assert count(settings, IngestBatch) == 1
    assert metric(client, "stored") == 4
    assert metric(client, "duplicate") == 4 * len(ENCODINGS)


def test_span_resent_inside_another_export_is_stored_once(client: TestClient, settings: CollectorSettings) -> None:
    spans = make_spans([vllm_attributes(i) for i in range(4)])
    assert export(client, spans[:3]).status_code == 200
    resp = export(client, spans[2:], "json-gzip")  # span 2 again, next to a new one
    assert resp.status_code == 200 and not export_response(resp).HasField("partial_success")
    assert export(client, [spans[1], spans[1]]).status_code == 200  # twice in one export, stored before
    assert [row.request_id for row in rows(settings)] == [f"chatcmpl-{i}" for i in range(4)]
    assert count(settings, OtlpSpan) == 4 and count(settings, IngestBatch) == 3
    assert metric(client, "stored") == 4 and metric(client, "duplicate") == 3


# --- partial success and refusals ----------------------------------------------------------------------

SECRET = "zz-private-value"


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_malformed_llm_request_spans_are_rejected_alone(
    client: TestClient, settings: CollectorSettings, encoding: str
) -> None:
    good = vllm_attributes(0)
    missing = {k: v for k, v in vllm_attributes(1).items() if k != "gen_ai.latency.e2e"}
    negative = {**vllm_attributes(2), "gen_ai.latency.time_in_queue": -1.0}
    wrong_type = {**vllm_attributes(3), "gen_ai.usage.prompt_tokens": SECRET}
    too_long = {**vllm_attributes(4), "gen_ai.request.id": SECRET * 20}
    resp = export(client, make_spans([good, missing, negative, wrong_type, too_long]), encoding)
    assert resp.status_code == 200, resp.content
    partial = export_response(resp).partial_success
    assert partial.rejected_spans == 4
    assert (
        partial.error_message
        == "4 llm_request span(s) rejected; first: span 1: gen_ai.latency.e2e missing or not a number"
    )
    assert SECRET not in resp.text
    assert [row.request_id for row in rows(settings)] == ["chatcmpl-0"]
    assert metric(client, "rejected") == 4 and metric(client, "stored") == 1


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"gen_ai.latency.time_in_queue": -1.0}, "gen_ai.latency.time_in_queue: Input should be greater than"),
        ({"gen_ai.usage.prompt_tokens": 2**40}, "gen_ai.usage.prompt_tokens: Input should be less than"),
        ({"gen_ai.latency.e2e": float("nan")}, "gen_ai.latency.e2e: Input should be a finite number"),
        ({"gen_ai.request.id": "a" * 201}, "gen_ai.request.id: String should have at most 200 characters"),
        ({"gen_ai.request.id": "a\x00b"}, "NUL characters are not allowed"),
        ({"gen_ai.usage.completion_tokens": 1.5}, "gen_ai.usage.completion_tokens missing or not an integer"),
    ],
    ids=["negative", "int32", "nan", "long-id", "nul", "fraction"],
)
def test_rejection_names_the_attribute(
    client: TestClient, settings: CollectorSettings, attrs: dict, message: str
) -> None:
    resp = export(client, make_spans([{**vllm_attributes(0), **attrs}]))
    partial = export_response(resp).partial_success
    assert resp.status_code == 200 and partial.rejected_spans == 1
    assert message in partial.error_message
    assert rows(settings) == [] and count(settings, IngestBatch) == 0


def test_other_spans_are_counted_and_ignored(client: TestClient, settings: CollectorSettings) -> None:
    resp = export(client, make_spans([vllm_attributes(0)], others=3), "json")
    assert resp.status_code == 200
    assert resp.json() == {}  # nothing of theirs is echoed
    assert len(rows(settings)) == 1
    assert metric(client, "ignored") == 3 and metric(client, "stored") == 1
    only_others = export(client, make_spans([], others=2))
    assert only_others.status_code == 200 and only_others.content == b""
    assert count(settings, IngestBatch) == 1 and metric(client, "ignored") == 5


def _bomb() -> bytes:
    return gzip.compress(b"\n" + b"\x00" * (512 * 1024), compresslevel=9)


@pytest.mark.parametrize(
    ("content", "headers", "status", "code"),
    [
        (b"\xff\xfe not protobuf", PROTOBUF, 400, 3),
        (b'{"resourceSpans": [', JSON, 400, 3),
        (b'{"resourceSpans": 7}', JSON, 400, 3),
        (b"not gzip", {**PROTOBUF, "Content-Encoding": "gzip"}, 400, 3),
        (b"", {"Content-Type": "text/plain"}, 415, 3),
        (b"", {}, 415, 3),
        (b"", {**PROTOBUF, "Content-Encoding": "br"}, 415, 3),
        (b"\x00" * (65 * 1024), PROTOBUF, 413, 8),
        (_bomb(), {**PROTOBUF, "Content-Encoding": "gzip"}, 413, 8),
    ],
    ids=[
        "bad-protobuf",
        "bad-json",
        "wrong-shape",
        "bad-gzip",
        "text",
        "no-content-type",
        "brotli",
        "too-large",
        "gzip-bomb",
    ],
)
def test_refusals_are_statuses_in_the_request_encoding(
    client: TestClient, settings: CollectorSettings, content: bytes, headers: dict, status: int, code: int
) -> None:
    resp = client.post("/v1/traces", content=content, headers={**headers, **AUTH})
    assert resp.status_code == status, resp.content
    expected_type = (
        "application/json" if headers.get("Content-Type") == "application/json" else "application/x-protobuf"
    )
    assert resp.headers["content-type"] == expected_type
    assert status_of(resp).code == code and status_of(resp).message
    assert rows(settings) == []


def test_too_many_spans_is_413(client: TestClient, settings: CollectorSettings) -> None:
    resp = export(client, make_spans([vllm_attributes(0)], others=settings.otlp_max_spans))
    assert resp.status_code == 413
    assert status_of(resp).message == "export has more than 50 spans; the limit is 50"
    assert rows(settings) == []


@pytest.mark.parametrize(("headers", "status", "code"), [({}, 401, 16), ({"Authorization": "Bearer nope"}, 403, 7)])
def test_token(client: TestClient, settings: CollectorSettings, headers: dict, status: int, code: int) -> None:
    body = protobuf_body(make_spans([vllm_attributes(0)]))
    resp = client.post("/v1/traces", content=body, headers={**PROTOBUF, **headers})
    assert resp.status_code == status and status_of(resp).code == code
    if status == 401:
        assert resp.headers["www-authenticate"] == "Bearer"
    assert rows(settings) == []


def test_storage_outage_is_retryable_503(
    client: TestClient, settings: CollectorSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_args: object, **_kwargs: object) -> None:
        raise StorageUnavailableError("connection refused")

    monkeypatch.setattr(ingest_routes, "store_pushes", down)  # an export is stored in a push's round
    resp = export(client, make_spans([vllm_attributes(0)]), "json")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert status_of(resp).code == 14 and "connection refused" not in resp.text


# --- the read path and the real exporter ---------------------------------------------------------------


def test_readers_see_the_vllm_instance(client: TestClient, settings: CollectorSettings) -> None:
    assert export(client, make_spans([vllm_attributes(i) for i in range(10)])).status_code == 200
    engine = make_engine(settings.db_url)
    [stats] = latency_percentiles(engine, start=T0, end=T0 + 60, metric="ttft", quantiles=(0.5, 1.0))
    engine.dispose()
    ttfts = sorted(vllm_attributes(i)["gen_ai.latency.time_to_first_token"] for i in range(10))
    assert (stats.group, stats.count) == ("vllm-h200-0", 10)
    assert stats.quantiles[0.5] == pytest.approx(ttfts[4]) and stats.quantiles[1.0] == pytest.approx(ttfts[-1])


def test_real_otlp_exporter(settings: CollectorSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTLPSpanExporter (http/protobuf, gzip) as vLLM configures it, the token from the standard env var."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", f"Authorization=Bearer%20{TOKEN}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    spans = make_spans([vllm_attributes(i) for i in range(5)], others=2)
    with run_in_thread(settings.model_copy(update={"port": 0, "log_level": "warning"})) as handle:
        exporter = OTLPSpanExporter(endpoint=f"{handle.url}/v1/traces", timeout=10)
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        assert exporter.export(spans) == SpanExportResult.SUCCESS  # a retry
        exporter.shutdown()
        wrong = OTLPSpanExporter(endpoint=f"{handle.url}/v1/traces", headers={"Authorization": "Bearer nope"})
        assert wrong.export(spans) == SpanExportResult.FAILURE
        wrong.shutdown()
    assert [row.request_id for row in rows(settings)] == [f"chatcmpl-{i}" for i in range(5)]
    assert count(settings, IngestBatch) == 1


def test_span_claims_are_pruned_with_the_raw_rows(client: TestClient, settings: CollectorSettings) -> None:
    assert export(client, make_spans([vllm_attributes(i) for i in range(3)])).status_code == 200
    engine = make_engine(settings.db_url)
    result = prune(engine, raw_days=1, downsample_days=2, now=time.time() + 3 * DAY)
    engine.dispose()
    assert result.deleted["otlp_spans"] == 3 and result.deleted["requests"] == 3
    assert count(settings, OtlpSpan) == 0


def test_request_events_bound_spans_before_converting() -> None:
    request = encode_spans(make_spans([vllm_attributes(0)], others=4))
    with pytest.raises(otlp.TooManySpansError):
        otlp.request_events(request, instance_map={}, max_spans=4)
    assert len(otlp.request_events(request, instance_map={}, max_spans=5).events) == 1


def test_overlapping_exports_stored_concurrently_keep_each_span_once(db_engine) -> None:
    """Stateless collectors on one database (no shared lock): the claims alone keep each span once."""
    spans = make_spans([vllm_attributes(i) for i in range(12)])
    request = encode_spans(spans)
    batches = []
    for start in range(0, 10, 2):  # windows of 4 spans, each overlapping the next by 2, each sent twice
        window = otlp.request_events(request, instance_map={}, max_spans=50)
        window.events, window.span_ids = window.events[start : start + 4], window.span_ids[start : start + 4]
        batches += [window, window]
    errors: list[BaseException] = []
    start_together = threading.Barrier(len(batches))

    def send(batch: otlp.SpanBatch) -> None:
        parsed = batch_from_events(batch.events, max_events=50, span_ids=batch.span_ids)
        start_together.wait(10)
        try:
            store_batch(db_engine, parsed, idempotency_key=batch.idempotency_key, content=batch.identity)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    with db_engine.connect() as conn:
        ids = conn.execute(select(RequestRow.request_id)).scalars().all()
    assert sorted(ids) == sorted(f"chatcmpl-{i}" for i in range(12))
