"""Workloads a study replays: the seed's scenarios, Azure trace replay, and one fitted from the collector.

Scenarios are sized relative to the measured capacity of the default config on the same profile
(`capacity_rps`), so the same names mean the same load on a 2-core CPU and on an H200:
- `mixed`: the 30/60/10 short/medium/long mix, Poisson arrivals at `load` x capacity (default 0.9);
- `burst`: 0.5 x capacity, rising by +500% (6x) for 2 s in the middle;
- `sustained`: 0.8 x capacity for `duration_s`.
`trace:FILE` replays an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens);
`stored` (or `stored:INSTANCE`) replays the stored requests themselves as they came: their recorded arrivals,
bursts kept, and their token counts, whatever engine served them (`recorded_traffic`): what the nightly job, the
demo and the vLLM tuning replay unless told otherwise;
`fitted` (formerly `collector`) fits arrival rates per minute and the (prompt, output) length mix of the last N
hours of stored requests and samples Poisson arrivals from them: the average rate, bursts smoothed away.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections import Counter
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


# --- the stored traffic itself, as it came ------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """Requests the collector stored, replayed as they came, and what was done to them on the way."""

    requests: list[W.WorkloadRequest]
    stored: int  # rows read (the latest `requests` of the window)
    unfinished: int  # refused, failed or aborted: demand too, replayed with the lengths they had
    filled: int  # lengths a row did not record (a refused request's output), taken from the finished median
    user_arrivals: int  # of the replayed requests, those whose row measured the stage before the engine


def recorded_traffic(
    db: Engine,
    opts: WorkloadOptions,
    *,
    instances: list[str] | None = None,
    run_id: str | None = None,
    start: float | None = None,
    end: float | None = None,
) -> Recorded:
    """The requests stored in the last `hours` (or `start`..`end`), replayed at their recorded arrivals: kvpilot
    request events or vLLM `llm_request` span rows alike (`collector.queries.request_arrivals`).

    Arrivals are as users sent them (the HTTP arrival where the row has the stage before the engine, `frontend_s`)
    relative to the first, compressed by `time_scale`, so bursts stay bursts; lengths are as stored (divided by
    `length_scale`, clipped to `max_total_tokens`). Bounded: the latest `requests` of the window, and with
    `duration_s` only the arrivals of its last `duration_s` seconds of replay. Refused and failed requests were
    demand too and are replayed; a length a row lacks (a refused request generated nothing) is the median of
    the finished requests'. Without `instances`, the tuner's own replays are left out."""
    from collector.queries import request_arrivals

    opts.validate()
    end = time.time() if end is None else end
    start = end - opts.hours * 3600.0 if start is None else start
    rows = request_arrivals(db, start=start, end=end, limit=opts.requests, instances=instances, run_id=run_id)
    finished = [r for r in rows if r.status == "finished" and r.output_tokens > 0 and r.prompt_tokens > 0]
    where = f" of {', '.join(instances)}" if instances else ""
    if not finished:
        raise WorkloadError(
            "hours",
            f"the collector holds {len(rows)} requests{where} between {start:.0f} and {end:.0f}, none finished "
            "(no lengths to replay); widen --hours or use a scenario workload",
        )
    prompt_fill = round(statistics.median(r.prompt_tokens for r in finished))
    output_fill = round(statistics.median(r.output_tokens for r in finished))
    t0 = rows[0].arrival
    offsets = [(r.arrival - t0) / opts.time_scale for r in rows]
    first = 0
    if opts.duration_s is not None:
        while offsets[-1] - offsets[first] >= opts.duration_s:
            first += 1
    out: list[W.WorkloadRequest] = []
    filled = 0
    for row, at in zip(rows[first:], offsets[first:], strict=True):
        prompt, output = row.prompt_tokens, row.output_tokens
        if prompt < 1 or output < 1:
            filled += 1
            prompt, output = (prompt if prompt >= 1 else prompt_fill), (output if output >= 1 else output_fill)
        p = max(2, round(prompt / opts.length_scale))
        o = max(1, round(output / opts.length_scale))
        p, o = clip_lengths(p, o, opts.max_total_tokens)
        out.append(W.WorkloadRequest(at - offsets[first], p, o, row.priority, None, _kind(prompt)))
    if filled:
        log.info("recorded traffic: %d of %d requests lacked a length; the finished median stands in", filled, len(out))
    return Recorded(
        requests=out,
        stored=len(rows),
        unfinished=sum(r.status != "finished" for r in rows[first:]),
        filled=filled,
        user_arrivals=sum(r.user_facing for r in rows[first:]),
    )


def burstiness(reqs: list[W.WorkloadRequest]) -> dict[str, float]:
    """How bursty the arrivals are: the busiest second's arrivals against the median of the seconds that had
    any (a steady Poisson stream gives about 2x, the demo's +500% burst 5x or more)."""
    if not reqs:
        return {"peak_1s_arrivals": 0, "median_1s_arrivals": 0.0, "peak_ratio": 0.0}
    per_second = Counter(math.floor(r.arrival_s) for r in reqs)
    median = float(statistics.median(per_second.values()))
    peak = max(per_second.values())
    return {"peak_1s_arrivals": peak, "median_1s_arrivals": median, "peak_ratio": round(peak / median, 2)}


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
        **burstiness(reqs),
    }


def default_max_total(config: EngineConfig) -> int:
    return min(config.model.max_position, config.server.max_prompt_tokens + config.server.max_tokens_limit)
