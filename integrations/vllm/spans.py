"""vLLM's `llm_request` span as a request: which attribute holds which stage, and the stamps kvpilot adds.

vLLM (v1 `OutputProcessor.do_tracing`) exports one SERVER span named `llm_request` per finished request: it
starts at the request's arrival and carries the stages as `gen_ai.latency.*` attributes
(vllm/tracing/utils.py `SpanAttributes`). `request_fields` maps one span's attributes to the fields of a
request event; the collector decodes the export, names the instance, validates and stores (`collector.otlp`).
Attributes come in as plain values (int, float, str, bool), so nothing here depends on the OTLP encoding.

The stage before the engine: vLLM's span starts at its renderer's `arrival_time`, after the API server
has read the HTTP request. `kvpilot vllm serve` stamps the HTTP arrival on the trace context
(`asgi/kvpilot_arrival.py`), and the span carries it back in its tracestate as `kvpilot=t<epoch
microseconds>`: `frontend_s` is the span's start minus that stamp. Without a stamp (vLLM started some other
way), or with one that cannot be this span's (after its start, or more than `MAX_FRONTEND_S` before it),
`frontend_s` stays None: not measured, never guessed.

TTFT to the first bytes served: `kvpilot vllm serve`'s middleware also writes, on a streamed request's span,
when its first bytes went to the HTTP server (`kvpilot.first_byte_time`, epoch seconds). vLLM stamps its
first token earlier, when its output loop takes it from the engine; so `ttft_s` becomes the time from vLLM's
arrival to those bytes (never less than vLLM's own figure, at most `MAX_FRONTEND_S` more), and `e2e_s` is
at least that. Without the attribute, `ttft_s` is vLLM's `time_to_first_token`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LLM_REQUEST = "llm_request"
REQUEST_ID = "gen_ai.request.id"
# RequestEvent field <- vLLM's attribute. time_in_model_inference is prefill + decode, so it is not stored;
# the sampling parameters are not part of a request row.
REQUIRED_SECONDS = {
    "queue_s": "gen_ai.latency.time_in_queue",
    "prefill_s": "gen_ai.latency.time_in_model_prefill",
    "decode_s": "gen_ai.latency.time_in_model_decode",
    "e2e_s": "gen_ai.latency.e2e",
}
OPTIONAL_SECONDS = {"ttft_s": "gen_ai.latency.time_to_first_token"}
REQUIRED_COUNTS = {"prompt_tokens": "gen_ai.usage.prompt_tokens", "output_tokens": "gen_ai.usage.completion_tokens"}
ARRIVAL_STAMP_KEY = "kvpilot"
FIRST_BYTE = "kvpilot.first_byte_time"
MAX_FRONTEND_S = 3600.0
CLOCK_SLACK_S = 0.001  # the stamp and vLLM's arrival_time read one clock, rounded to the microsecond
SPAN_ATTRIBUTES = frozenset(
    {*REQUIRED_SECONDS.values(), *OPTIONAL_SECONDS.values(), *REQUIRED_COUNTS.values(), REQUEST_ID, FIRST_BYTE}
)
# request field -> where it came from, for error messages
FIELD_SOURCE = {
    **REQUIRED_SECONDS,
    **OPTIONAL_SECONDS,
    **REQUIRED_COUNTS,
    "request_id": REQUEST_ID,
    "ts": "the span's start time plus gen_ai.latency.e2e",
    "frontend_s": "tracestate kvpilot (the HTTP arrival)",
}


class SpanRejected(ValueError):
    """Why one llm_request span cannot be a request row; the text names attributes, never values."""


def request_fields(attrs: Mapping[str, Any], *, start: float, trace_state: str) -> dict[str, Any]:
    """The request event fields of one `llm_request` span: its attributes, start (epoch seconds) and tracestate.

    Raises SpanRejected for a required attribute missing or of the wrong type."""
    fields: dict[str, Any] = {}
    for name, key in REQUIRED_SECONDS.items():
        fields[name] = _number(attrs, key, required=True)
    for name, key in OPTIONAL_SECONDS.items():
        fields[name] = _number(attrs, key, required=False)
    for name, key in REQUIRED_COUNTS.items():
        fields[name] = _count(attrs, key)
    request_id = attrs.get(REQUEST_ID)
    if not isinstance(request_id, str):
        raise SpanRejected(f"{REQUEST_ID} missing or not a string")
    fields["request_id"] = request_id
    fields["frontend_s"] = frontend_seconds(trace_state, start)
    first_byte = _number(attrs, FIRST_BYTE, required=False)
    if first_byte is not None:
        served = first_byte - start
        engine_ttft = fields["ttft_s"] if fields["ttft_s"] is not None else 0.0
        if -CLOCK_SLACK_S <= served - engine_ttft <= MAX_FRONTEND_S:
            fields["ttft_s"] = max(served, engine_ttft)
            fields["e2e_s"] = max(fields["e2e_s"], fields["ttft_s"])
    # the wall-clock time of the final stage, as kvpilot's engine stamps its request events
    fields["ts"] = start + fields["e2e_s"]
    return fields


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


def _number(attrs: Mapping[str, Any], key: str, *, required: bool) -> float | None:
    value = attrs.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if value is None and not required:
        return None
    raise SpanRejected(f"{key} missing or not a number")


def _count(attrs: Mapping[str, Any], key: str) -> int:
    value = attrs.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise SpanRejected(f"{key} missing or not an integer")
