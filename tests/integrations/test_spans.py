"""vLLM's `llm_request` attributes as request fields, on plain values (the collector's OTLP tests cover the wire)."""

from __future__ import annotations

import pytest

from integrations.vllm.spans import FIRST_BYTE, REQUIRED_COUNTS, REQUIRED_SECONDS, SpanRejected, request_fields

ATTRS = {
    "gen_ai.request.id": "cmpl-1",
    "gen_ai.latency.time_in_queue": 0.01,
    "gen_ai.latency.time_in_model_prefill": 0.02,
    "gen_ai.latency.time_in_model_decode": 0.5,
    "gen_ai.latency.e2e": 0.6,
    "gen_ai.latency.time_to_first_token": 0.05,
    "gen_ai.usage.prompt_tokens": 12,
    "gen_ai.usage.completion_tokens": 30.0,  # an integral double is a count
}


def test_a_span_maps_to_the_fields_of_a_request_event() -> None:
    fields = request_fields(ATTRS, start=100.0, trace_state="kvpilot=t99750000")
    assert set(fields) >= {*REQUIRED_SECONDS, *REQUIRED_COUNTS, "ttft_s", "request_id", "frontend_s", "ts"}
    assert fields["output_tokens"] == 30 and isinstance(fields["output_tokens"], int)
    assert fields["frontend_s"] == pytest.approx(0.25)
    assert fields["ts"] == pytest.approx(100.6)


def test_first_bytes_served_set_ttft_and_bound_e2e() -> None:
    fields = request_fields({**ATTRS, FIRST_BYTE: 100.7}, start=100.0, trace_state="")
    assert fields["ttft_s"] == pytest.approx(0.7) and fields["e2e_s"] == pytest.approx(0.7)
    assert fields["frontend_s"] is None


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("gen_ai.latency.e2e", True, "gen_ai.latency.e2e missing or not a number"),
        ("gen_ai.usage.prompt_tokens", 1.5, "gen_ai.usage.prompt_tokens missing or not an integer"),
        ("gen_ai.request.id", 7, "gen_ai.request.id missing or not a string"),
        ("gen_ai.latency.time_to_first_token", "0.1", "gen_ai.latency.time_to_first_token missing or not a number"),
    ],
)
def test_a_wrong_type_is_named_by_its_attribute(key: str, value: object, named: str) -> None:
    with pytest.raises(SpanRejected, match=named):
        request_fields({**ATTRS, key: value}, start=100.0, trace_state="")
