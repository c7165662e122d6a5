"""Workloads a study replays: the seed's scenarios, Azure trace replay, and one fitted from the collector.

Scenarios are sized relative to the measured capacity of the default config on the same profile
(`capacity_rps`), so the same names mean the same load on a 2-core CPU and on an H200:
- `mixed`: the 30/60/10 short/medium/long mix, Poisson arrivals at `load` x capacity (default 0.9);
- `burst`: 0.5 x capacity, rising by +500% (6x) for 2 s in the middle;
- `sustained`: 0.8 x capacity for `duration_s`.
`trace:FILE` replays an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens);
`collector` fits arrival rates and the (prompt, output) length mix of the last N hours of stored requests;
`stored` replays those requests themselves (arrival = ts - e2e, their token counts), whatever engine served them.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine

from engine import workload as W
from engine.config import EngineConfig
from plumbing.lengths import clip_lengths

log = logging.getLogger("kvpilot.tuner.workloads")

SCENARIOS = ("mixed", "burst", "sustained")
TRACE_COLUMNS = W.TRACE_COLUMNS


class WorkloadError(ValueError):
    """A workload that cannot be built; `field` names the option or input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class WorkloadOptions:
    requests: int = 200
    scale: float = 4.0  # divides prompt lengths (the seed's mix at CPU size)
    output_range: tuple[int, int] = (16, 256)
    load: float | None = None  # x capacity; None: the scenario's own
    duration_s: float | None = None  # burst/sustained length; None: sized to `requests`
    time_scale: float = 1.0  # trace/collector: 2.0 replays twice as fast
    length_scale: float = 1.0  # trace/collector: divides token counts
    max_total_tokens: int | None = None  # clip prompt + output (the model's positions)
    hours: float = 24.0  # collector: how far back
    max_rows: int = 200_000  # collector: rows read at most

    def validate(self) -> WorkloadOptions:
        if self.requests < 1:
            raise WorkloadError("requests", f"must be >= 1, got {self.requests}")
        for name in ("scale", "time_scale", "length_scale", "hours"):
            if not getattr(self, name) > 0:
                raise WorkloadError(name, f"must be positive, got {getattr(self, name)}")
        lo, hi = self.output_range
        if not 1 <= lo <= hi:
            raise WorkloadError("output_range", f"must be 1 <= low <= high, got {self.output_range}")
        if self.load is not None and not self.load > 0:
            raise WorkloadError("load", f"must be positive, got {self.load}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError("duration_s", f"must be positive, got {self.duration_s}")
        return self


def _kind(prompt: int) -> str:
    return "short" if prompt < 512 else "medium" if prompt <= 2048 else "long"


def scenario(name: str, capacity_rps: float, opts: WorkloadOptions, *, seed: int = 0) -> list[W.WorkloadRequest]:
    """One of SCENARIOS at a load relative to `capacity_rps` (requests/s of the default config)."""
    opts.validate()
    if not capacity_rps > 0:
        raise WorkloadError("capacity", f"capacity must be positive, got {capacity_rps}")
    mix = {"scale": opts.scale, "output_range": opts.output_range}
    if name == "mixed":
        rate = (opts.load or 0.9) * capacity_rps
        reqs = W.mixed(opts.requests, seed=seed, rate=rate, **mix)
    elif name == "burst":
        base = (opts.load or 0.5) * capacity_rps
        duration = opts.duration_s or max(6.0, opts.requests / base * 0.75)
        reqs = W.burst(duration, base_rate=base, burst_at_s=duration / 2 - 1.0, factor=6.0, seed=seed, **mix)
    elif name == "sustained":
        rate = (opts.load or 0.8) * capacity_rps
        duration = opts.duration_s or opts.requests / rate
        pool = W.mixed(int(duration * rate * 1.5) + 16, seed=seed, rate=rate, **mix)
        reqs = [r for r in pool if r.arrival_s < duration]
    else:
        raise WorkloadError(
            "workload", f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}, trace:FILE, collector"
        )
    return [_clipped(r, opts.max_total_tokens) for r in reqs]


def _clipped(r: W.WorkloadRequest, max_total: int | None) -> W.WorkloadRequest:
    prompt, output = clip_lengths(r.prompt_tokens, r.output_tokens, max_total)
    if (prompt, output) == (r.prompt_tokens, r.output_tokens):
        return r
    return W.WorkloadRequest(r.arrival_s, prompt, output, r.priority, r.prefix_group, r.kind)


def offline_mix(opts: WorkloadOptions, *, seed: int = 0, n: int = 96) -> list[W.WorkloadRequest]:
    """All-at-once requests of the scenario mix: what capacity is measured on."""
    reqs = W.mixed(n, seed=seed + 7919, scale=opts.scale, output_range=opts.output_range)
    return [_clipped(r, opts.max_total_tokens) for r in reqs]


# --- Azure LLM inference trace ---------------------------------------------------------------------


def load_trace(path: str | Path, opts: WorkloadOptions) -> list[W.WorkloadRequest]:
    """Requests of an Azure trace: arrivals from the first row divided by `time_scale`, token counts
    divided by `length_scale`, at most `requests` rows (and `duration_s` after scaling)."""
    opts.validate()
    try:
        rows = W.read_azure_trace(path)
    except W.TraceError as exc:
        raise WorkloadError("trace", str(exc)) from exc
    for ts, _context, generated in rows:
        if generated < 1:
            raise WorkloadError("trace", f"{path}: a row at {ts} has GeneratedTokens {generated}; need >= 1")
    t0 = rows[0][0]
    out: list[W.WorkloadRequest] = []
    for ts, context, generated in rows:
        arrival = (ts - t0) / opts.time_scale
        if (opts.duration_s is not None and arrival >= opts.duration_s) or len(out) >= opts.requests:
            break
        prompt = max(2, round(context / opts.length_scale))
        output = max(1, round(generated / opts.length_scale))
        prompt, output = clip_lengths(prompt, output, opts.max_total_tokens)
        out.append(W.WorkloadRequest(arrival, prompt, output, 1, None, _kind(context)))
    return out


# --- fitted from the collector ---------------------------------------------------------------------


@dataclass(frozen=True)
class FittedWorkload:
    """What the last hours looked like: arrival rate per bucket and the observed (prompt, output) pairs."""

    start: float
    end: float
    bucket_s: float
    rates: list[float]  # requests/s per bucket, all statuses (rejected requests were demand too)
    shapes: list[tuple[int, int, int]]  # (prompt, output, priority) of finished requests
    requests: int

    def sample(self, opts: WorkloadOptions, *, seed: int = 0) -> list[W.WorkloadRequest]:
        """A synthetic replay: Poisson arrivals following the rate profile (time-compressed by
        `time_scale`), lengths resampled from the observed pairs; at most `requests` requests."""
        rng = random.Random(seed)
        out: list[W.WorkloadRequest] = []
        bucket = self.bucket_s / opts.time_scale
        for b, rate in enumerate(self.rates):
            t = b * bucket
            if rate <= 0:
                continue
            scaled = rate * opts.time_scale
            while len(out) < opts.requests:
                t += rng.expovariate(scaled)
                if t >= (b + 1) * bucket or (opts.duration_s is not None and t >= opts.duration_s):
                    break
                prompt, output, prio = rng.choice(self.shapes)
                prompt = max(2, round(prompt / opts.length_scale))
                output = max(1, round(output / opts.length_scale))
                prompt, output = clip_lengths(prompt, output, opts.max_total_tokens)
                out.append(W.WorkloadRequest(t, prompt, output, prio, None, _kind(prompt)))
        return out


def fit_from_collector(
    db: Engine,
    opts: WorkloadOptions,
    *,
    instances: list[str] | None = None,
    now: float | None = None,
    bucket_s: float = 60.0,
    min_requests: int = 20,
) -> FittedWorkload:
    """Fit the last `hours` of requests the collector stored (warm-up excluded); reads through
    `collector.queries` (request counts, then every request row of the window)."""
    from collector.queries import request_rates, slowest_requests

    opts.validate()
    end = time.time() if now is None else now
    start = end - opts.hours * 3600.0
    rates = request_rates(db, start=start, end=end, group_by="all", instances=instances)
    total = sum(r.requests for r in rates)
    if total > opts.max_rows:  # keep the most recent part of the window that fits
        start = end - (end - start) * opts.max_rows / total
        log.warning(
            "collector workload: %d requests in %.1f h; fitting the last %.2f h",
            total,
            opts.hours,
            (end - start) / 3600,
        )
        total = sum(r.requests for r in request_rates(db, start=start, end=end, group_by="all", instances=instances))
    if total < min_requests:
        raise WorkloadError(
            "hours",
            f"the collector holds {total} requests in the last {opts.hours:g} h (need >= {min_requests}); "
            "widen --hours or use a scenario workload",
        )
    rows = slowest_requests(db, start=start, end=end, metric="e2e", limit=total, instances=instances)
    arrivals = [float(r["ts"]) - float(r["e2e_s"]) for r in rows]
    first = max(start, min(arrivals))
    n_buckets = max(1, int((end - first) // bucket_s) + 1)
    counts = [0] * n_buckets
    for a in arrivals:
        counts[min(n_buckets - 1, max(0, int((a - first) // bucket_s)))] += 1
    # Trim the idle tail after the last arrival so the replay does not end with empty minutes.
    while len(counts) > 1 and counts[-1] == 0:
        counts.pop()
    shapes = [
        (int(r["prompt_tokens"]), int(r["output_tokens"]), int(r["priority"]))
        for r in rows
        if r["status"] == "finished" and int(r["output_tokens"]) > 0 and int(r["prompt_tokens"]) > 1
    ]
    if not shapes:
        raise WorkloadError("hours", "no finished requests in the window to take lengths from")
    shapes.sort()
    return FittedWorkload(first, end, bucket_s, [c / bucket_s for c in counts], shapes, len(rows))


# --- the stored traffic itself ----------------------------------------------------------------------


def stored_traffic(
    db: Engine,
    opts: WorkloadOptions,
    *,
    instances: list[str] | None = None,
    run_id: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> list[W.WorkloadRequest]:
    """The requests the collector stored (kvpilot request events or vLLM `llm_request` span rows alike), replayed
    as they came: arrival = ts - e2e relative to the first, prompt and completion tokens as stored (divided by
    `length_scale`, clipped to `max_total_tokens`), time compressed by `time_scale`; finished requests of the
    last `hours` (or `start`..`end`), the first `requests` of them. Refused and failed requests left no lengths."""
    from collector.queries import request_rates, slowest_requests

    opts.validate()
    end = time.time() if end is None else end
    start = end - opts.hours * 3600.0 if start is None else start
    rates = request_rates(db, start=start, end=end, group_by="all", instances=instances, run_id=run_id)
    total = min(sum(r.requests for r in rates), opts.max_rows)
    rows = slowest_requests(db, start=start, end=end, metric="e2e", limit=total, instances=instances, run_id=run_id)
    done = sorted(
        (
            (float(r["ts"]) - float(r["e2e_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]), int(r["priority"]))
            for r in rows
            if r["status"] == "finished" and int(r["output_tokens"]) > 0 and int(r["prompt_tokens"]) > 0
        ),
    )
    if not done:
        raise WorkloadError("hours", f"the collector holds no finished requests between {start:.0f} and {end:.0f}")
    if len(done) < len(rows):
        log.info(
            "stored traffic: %d of %d requests were not finished and are left out", len(rows) - len(done), len(rows)
        )
    t0 = done[0][0]
    out: list[W.WorkloadRequest] = []
    for arrival, prompt, output, prio in done[: opts.requests]:
        at = (arrival - t0) / opts.time_scale
        if opts.duration_s is not None and at >= opts.duration_s:
            break
        p = max(2, round(prompt / opts.length_scale))
        o = max(1, round(output / opts.length_scale))
        p, o = clip_lengths(p, o, opts.max_total_tokens)
        out.append(W.WorkloadRequest(at, p, o, prio, None, _kind(prompt)))
    return out


def describe(reqs: list[W.WorkloadRequest]) -> dict:
    """Summary figures of a workload for reports."""
    if not reqs:
        return {"requests": 0}
    span = max(r.arrival_s for r in reqs)
    return {
        "requests": len(reqs),
        "span_s": round(span, 3),
        "rate_rps": round(len(reqs) / span, 3) if span > 0 else None,
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in reqs) / len(reqs), 1),
        "output_tokens_mean": round(sum(r.output_tokens for r in reqs) / len(reqs), 1),
        "kinds": {k: sum(r.kind == k for r in reqs) for k in ("short", "medium", "long")},
    }


def default_max_total(config: EngineConfig) -> int:
    return min(config.model.max_position, config.server.max_prompt_tokens + config.server.max_tokens_limit)
