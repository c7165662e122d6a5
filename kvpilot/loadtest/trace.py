"""Replay of Azure LLM inference traces (AzurePublicDataset: TIMESTAMP, ContextTokens, GeneratedTokens).

TIMESTAMP is either a datetime (`2023-11-16 18:15:46.6805900`, the published files; 7 fractional digits
are cut to microseconds) or plain seconds. Arrivals are offsets from the first row, divided by
`time_scale` (2.0 replays twice as fast); prompt lengths are divided by `length_scale` and output
lengths by `output_scale` (as in the synthetic scenarios), then clipped to `max_total_tokens`. Rows past
`duration_s` (after scaling) are not sent.
"""

from __future__ import annotations

from pathlib import Path

from engine import workload as W
from kvpilot.loadtest.plan import PlanError, PlannedRequest
from plumbing.lengths import clip_lengths

COLUMNS = W.TRACE_COLUMNS


def load_trace(
    path: Path,
    *,
    duration_s: float | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float = 1.0,
    max_total_tokens: int | None = None,
    max_requests: int | None = None,
) -> list[PlannedRequest]:
    if not time_scale > 0:
        raise PlanError("--trace-time-scale", f"must be positive, got {time_scale}")
    if not length_scale > 0:
        raise PlanError("--length-scale", f"must be positive, got {length_scale}")
    if not output_scale > 0:
        raise PlanError("--output-scale", f"must be positive, got {output_scale}")
    try:
        rows = W.read_azure_trace(path)
    except W.TraceError as exc:
        raise PlanError("--trace", str(exc)) from exc
    t0 = rows[0][0]
    out: list[PlannedRequest] = []
    for ts, context, generated in rows:
        arrival = (ts - t0) / time_scale
        if duration_s is not None and arrival >= duration_s:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        prompt = max(2, round(context / length_scale))
        output = max(1, round(generated / output_scale))
        prompt, output = clip_lengths(prompt, output, max_total_tokens)
        kind = "short" if context < 512 else "medium" if context <= 2048 else "long"
        out.append(PlannedRequest(len(out), arrival, prompt, output, kind))
    return out
