"""POST /v1/traces against exports crafted to cost more than they weigh, and the span-level refusals.

Counted before decoding: a protobuf export is walked on the wire, an OTLP/JSON one bounded before
`json.loads`. Spies on the decoders assert they never ran.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from collector import otlp, otlpscan
from collector.server import create_app
from collector.settings import CollectorSettings
from tests.collector import evfactory as ev
from tests.collector.test_otlp import (
    AUTH,
    JSON,
    PROTOBUF,
    TOKEN,
    export_response,
    json_body,
    make_spans,
    metric,
    protobuf_body,
    rows,
    status_of,
    vllm_attributes,
)


@pytest.fixture
def settings(sqlite_url: str) -> CollectorSettings:
    return CollectorSettings(
        db_url=sqlite_url,
        ingest_token=TOKEN,
        scrape_enabled=False,
        otlp_max_spans=1000,
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )


@pytest.fixture
def client(settings: CollectorSettings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which decoders ran: protobuf's ParseFromString and json.loads, as otlp calls them."""
    calls: list[str] = []
    real_request, real_json = otlp.ExportTraceServiceRequest, otlp.json

    class Request:
        def __new__(cls) -> Any:
            message = real_request()
            calls.append("protobuf")
            return message

    class Json:
        @staticmethod
        def loads(body: bytes) -> Any:
            calls.append("json")
            return real_json.loads(body)

        dumps = staticmethod(real_json.dumps)

    monkeypatch.setattr(otlp, "ExportTraceServiceRequest", Request)
    monkeypatch.setattr(otlp, "json", Json)
    return calls


def ld(field: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    size, out = len(payload), bytearray()
    while True:
        out.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return bytes([field << 3 | 2]) + bytes(out) + payload


def one_scope(spans: bytes) -> bytes:
    """ExportTraceServiceRequest{resource_spans{scope_spans{<spans>}}}."""
    return ld(1, ld(2, spans))


GZ_PROTOBUF = {**PROTOBUF, **AUTH, "Content-Encoding": "gzip"}
GZ_JSON = {**JSON, **AUTH, "Content-Encoding": "gzip"}


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (one_scope(ld(2, b"") * 2_000_000), GZ_PROTOBUF, "more than 1000 spans"),
        (one_scope(ld(2, ld(9, b"") * 2_000_000)), GZ_PROTOBUF, "more messages than 1000 spans may hold"),
        (one_scope(ld(2, b"\x08\x00" * 2_000_000)), GZ_PROTOBUF, "more wire fields than 1000 spans may hold"),
        (
            b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + b"{}," * 2_000_000 + b"{}]}]}]}",
            GZ_JSON,
            "more JSON values than 1000 spans may hold",
        ),
    ],
    ids=["protobuf-empty-spans", "protobuf-empty-attributes", "protobuf-scalar-fields", "json-empty-spans"],
)
def test_amplifying_exports_are_413_before_decoding(
    client: TestClient, decoded: list[str], body: bytes, headers: dict, message: str
) -> None:
    wire = gzip.compress(body, 9)
    assert len(wire) < len(body) // 100
    resp = client.post("/v1/traces", content=wire, headers=headers)
    assert resp.status_code == 413, resp.content
    assert message in status_of(resp).message
    assert decoded == []
    assert 'kvpilot_collector_ingest_rejected_total{reason="too_many_spans"} 1.0' in client.get("/metrics").text


def test_json_spans_are_counted_before_the_protobuf_mapping(client: TestClient, decoded: list[str]) -> None:
    spans = ",".join(['{"name":"x"}'] * 1001)
    body = f'{{"resourceSpans":[{{"scopeSpans":[{{"spans":[{spans}]}}]}}]}}'.encode()
    resp = client.post("/v1/traces", content=body, headers={**JSON, **AUTH})
    assert resp.status_code == 413 and status_of(resp).message == "export has 1001 spans; the limit is 1000"
    assert decoded == ["json"]  # decoded (within the value bound), never mapped to protobuf


def test_walker_counts_what_the_runtime_decodes() -> None:
    spans = make_spans([vllm_attributes(i) for i in range(7)], others=5)
    assert otlpscan.count_protobuf(protobuf_body(spans), max_spans=12) == 12
    with pytest.raises(otlpscan.ExportBoundError):
        otlpscan.count_protobuf(protobuf_body(spans), max_spans=11)
    for bad in (b"\x0a\x05ab", b"\x0b", b"\x0a"):  # length past the end, a group, truncated
        with pytest.raises(otlpscan.MalformedError):
            otlpscan.count_protobuf(bad, max_spans=10)


def test_real_exports_fit_the_bounds() -> None:
    """vLLM's spans as the SDK encodes them: far inside what max_spans of them may hold."""
    spans = make_spans([vllm_attributes(i) for i in range(100)])
    otlpscan.count_protobuf(protobuf_body(spans), max_spans=100)
    otlpscan.check_json_size(json_body(spans), max_spans=100)


def _json_export(spans: list[dict]) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()


def test_a_malformed_json_id_rejects_that_span_only(client: TestClient, settings: CollectorSettings) -> None:
    good = json.loads(json_body(make_spans([vllm_attributes(0), vllm_attributes(1)])))
    spans = good["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[1]["spanId"] = "not-hex"
    resp = client.post("/v1/traces", content=json.dumps(good).encode(), headers={**JSON, **AUTH})
    assert resp.status_code == 200, resp.content
    partial = export_response(resp).partial_success
    assert partial.rejected_spans == 1 and "span 1: invalid trace_id or span_id" in partial.error_message
    assert "not-hex" not in partial.error_message
    assert [r.request_id for r in rows(settings)] == ["chatcmpl-0"]


def test_a_span_repeated_in_one_export_is_counted(client: TestClient, settings: CollectorSettings) -> None:
    spans = make_spans([vllm_attributes(0)])
    resp = client.post("/v1/traces", content=protobuf_body([spans[0], spans[0]]), headers={**PROTOBUF, **AUTH})
    assert resp.status_code == 200
    partial = export_response(resp).partial_success
    assert partial.rejected_spans == 1 and "1 span(s) repeated" in partial.error_message
    assert len(rows(settings)) == 1 and metric(client, "duplicate") == 1


def test_json_mapping_gets_only_what_is_read() -> None:
    """The protobuf JSON mapping costs microseconds per value: spans and attributes nobody reads never reach it."""
    wanted = {"key": "gen_ai.request.id", "value": {"stringValue": "r-2"}}
    data = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "os.type", "value": {}}, {"key": "service.name", "value": {}}]},
                "scopeSpans": [
                    {
                        "spans": [
                            {"name": "chat", "attributes": [wanted] * 100, "events": [{}] * 100},
                            {
                                "name": "llm_request",
                                "spanId": "zz",
                                "attributes": [{"key": "gen_ai.request.id", "value": {}}, wanted]
                                + [{"key": f"junk.{i}", "value": {}} for i in range(100)],
                                "links": [{"traceId": "not-hex"}],
                            },
                        ]
                    }
                ],
            }
        ]
    }
    otlp._prepare_json(data)
    resource = data["resourceSpans"][0]
    assert resource["resource"] == {"attributes": [{"key": "service.name", "value": {}}]}
    other, llm = resource["scopeSpans"][0]["spans"]
    assert other == {"name": "chat"}
    assert llm == {"name": "llm_request", "spanId": "", "attributes": [wanted]}  # the last of each key
