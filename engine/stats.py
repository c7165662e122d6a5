"""Stats handed from the engine loop to its loggers (after vLLM's v1/metrics/stats.py).

The engine builds one `IterationStats` per step and a `FinishedRequest` per request that leaves;
loggers (`StatLogger`) turn them into telemetry events, Prometheus metrics or console lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.kv import KVStats


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    status: str  # finished | failed | rejected | aborted
    priority: int
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    prefill_s: float
    ttft_s: float | None
    decode_s: float
    e2e_s: float
    preemptions: int = 0
    swaps: int = 0
    swap_s: float = 0.0
    cached_tokens: int = 0
    finish_reason: str | None = None
    warmup: bool = False


@dataclass(slots=True)
class IterationStats:
    step: int
    duration_s: float
    forward_s: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    queue_depth: int
    running: int
    swapped: int
    preemptions: int
    swaps_out: int
    swaps_in: int
    generated_tokens: int
    oom_events: int
    warmup: bool
    kv: KVStats
    finished: list[FinishedRequest] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...

    def record_rejected(self, request: FinishedRequest) -> None: ...
