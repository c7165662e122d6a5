"""The versioned wire schema engines push to the collector.

This module is the one contract between engine and collector (docs/architecture.md): the engine builds these
objects, the collector validates and stores them. Every event carries `instance`, `run_id` and an
epoch timestamp in UTC seconds so events from many engines can be merged and ordered. It lives in the
engine package, which imports no other kvpilot package: the collector, the engine integrations
(`integrations`) and the load tester all build on it without importing each other.

Version policy: `v` is the schema version of one event type. A reader accepts only versions it knows,
so an engine newer than its collector gets a clear 422 instead of silently dropped fields. A new event
type starts at version 1 and leaves the others' versions alone; a collector older than the type refuses
a batch that holds one (422, the unknown `type` named), so senders put a new type in batches of its own
(the HTTP sink sends `gap` records that way: an old collector loses the record, never the data).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

SCHEMA_VERSION: Final = 1

RequestStatus = Literal["finished", "failed", "rejected", "aborted"]
AllocOp = Literal["alloc", "free", "swap_out", "swap_in", "evict", "recycle", "oom"]
Tier = Literal["hot", "cold"]
LostKind = Literal["request", "step", "alloc", "sample", "unknown"]  # unknown: an unreadable spool file
LossReason = Literal["queue_full", "spool_full", "unauthorized", "rejected", "shutdown"]

NonNegFloat = Annotated[float, Field(ge=0.0)]
NonNegInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = SCHEMA_VERSION
    instance: Annotated[str, Field(min_length=1, max_length=200)]
    run_id: Annotated[str, Field(min_length=1, max_length=200)]
    ts: Annotated[float, Field(gt=0.0, description="epoch seconds, UTC")]


class RequestEvent(_Event):
    """One per request that left the engine (finished, failed, rejected or aborted).

    Stage durations are derived from monotonic stage timestamps inside the engine, so they never go
    negative when the wall clock steps; `ts` is the wall-clock time of the final stage.

    `frontend_s` is the time before the engine's own clock starts: from the request's arrival at the
    server's HTTP layer to the engine's arrival stamp (for vLLM: request parsing and the API server's event
    loop before its renderer stamps `arrival_time`). `ttft_s` and `e2e_s` start at the engine's stamp, so
    what a user waited is `frontend_s + ttft_s` (for vLLM started by `kvpilot vllm serve`, `ttft_s` runs to
    the first token's bytes handed to the HTTP server: collector.otlp). 0 when the source's own arrival stamp
    is the HTTP arrival (kvpilot's engine stamps it in its HTTP handler; a load generator's client clock);
    None when it was not measured (a vLLM not started by `kvpilot vllm serve`): its TTFT and e2e then leave
    that time out.
    """

    type: Literal["request"] = "request"
    request_id: Annotated[str, Field(min_length=1, max_length=200)]
    status: RequestStatus
    priority: NonNegInt = 1
    prompt_tokens: NonNegInt
    output_tokens: NonNegInt
    frontend_s: NonNegFloat | None = None
    queue_s: NonNegFloat
    prefill_s: NonNegFloat
    ttft_s: NonNegFloat | None = None
    decode_s: NonNegFloat
    e2e_s: NonNegFloat
    preemptions: NonNegInt = 0
    swaps: NonNegInt = 0
    swap_s: NonNegFloat = 0.0  # time spent swapped out to the host tier (counted inside decode_s/prefill_s)
    cached_tokens: NonNegInt = 0
    finish_reason: str | None = None
    warmup: bool = False


class StepEvent(_Event):
    """One per engine iteration. KV capacity is counted in base pages (the allocator's unit)."""

    type: Literal["step"] = "step"
    step: NonNegInt
    duration_s: NonNegFloat
    forward_s: NonNegFloat
    num_seqs: NonNegInt
    prefill_tokens: NonNegInt
    decode_tokens: NonNegInt
    kv_blocks_used: NonNegInt
    kv_blocks_total: NonNegInt
    queue_depth: NonNegInt
    busy_s: NonNegFloat
    preemptions: NonNegInt = 0
    swapped_seqs: NonNegInt = 0
    warmup: bool = False


class AllocEvent(_Event):
    """One KV allocation trace record: what happened to how much memory, and usage after it."""

    type: Literal["alloc"] = "alloc"
    op: AllocOp
    request_id: str | None = None
    blocks: NonNegInt
    block_size: NonNegInt
    bytes: NonNegInt
    tier: Tier = "hot"
    usage_after: Fraction


class SampleEvent(_Event):
    """Gauges sampled on an interval. Missing gauges stay None rather than a fake zero."""

    type: Literal["sample"] = "sample"
    utilization: Fraction | None = None
    memory_used_bytes: NonNegInt | None = None
    memory_total_bytes: NonNegInt | None = None
    kv_usage: Fraction | None = None
    cold_usage: Fraction | None = None
    fragmentation: Fraction | None = None
    internal_waste: Fraction | None = None
    queue_depth: NonNegInt | None = None
    running: NonNegInt | None = None
    swap_rate: NonNegFloat | None = None
    prefix_hit_rate: Fraction | None = None
    source: str = "engine"


class GapEvent(_Event):
    """Events of one type a sink lost for one reason, so the collector can show the hole they leave.

    One record sums `events` losses whose own timestamps span `first_ts`..`last_ts`; `ts` is when the sink
    cut the record (after the last of them). Reasons: `queue_full` (the engine outpaced the sink),
    `spool_full` (the collector was unreachable longer than the spool holds), `unauthorized` (the
    collector refused the ingest token, so the spool filled), `rejected` (the collector refused the batch
    for good), `shutdown` (unsent at exit without a spool directory).
    """

    type: Literal["gap"] = "gap"
    kind: LostKind
    reason: LossReason
    events: Annotated[int, Field(ge=1)]
    first_ts: NonNegFloat
    last_ts: NonNegFloat


Event = Annotated[RequestEvent | StepEvent | AllocEvent | SampleEvent | GapEvent, Field(discriminator="type")]
EVENT_TYPES: dict[str, type[_Event]] = {
    "request": RequestEvent,
    "step": StepEvent,
    "alloc": AllocEvent,
    "sample": SampleEvent,
    "gap": GapEvent,
}


class EventBatch(BaseModel):
    """What POST /v1/ingest takes. The idempotency key may also come as a header."""

    model_config = ConfigDict(extra="forbid")

    idempotency_key: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    events: Annotated[list[Event], Field(max_length=100_000)]


event_adapter: TypeAdapter[Event] = TypeAdapter(Event)


def event_to_json(event: _Event) -> dict:
    """The JSON-ready dict of one event (what sinks write and the collector reads)."""
    return event.model_dump(mode="json")


def parse_event(data: dict) -> RequestEvent | StepEvent | AllocEvent | SampleEvent | GapEvent:
    """Validate one event dict; raises pydantic.ValidationError naming the field."""
    return event_adapter.validate_python(data)
