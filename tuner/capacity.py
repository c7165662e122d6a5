"""SLO capacity: the largest multiple of a workload's arrival rate at which a config still meets its SLOs.

Goodput at one fixed rate cannot rank configs that all keep up with that rate (every one serves all of it), and
at a rate past everyone's capacity it swings with the queue's chaos. Capacity asks what an operator buys: how
much more of *this* traffic (its arrivals, bursts kept, time-compressed by the multiplier) one server of the
config takes before its users see the SLOs break. The SLOs are read from the request rows as the collector
stored them (`tuner.metrics.trial_metrics`: p99 TTFT as users see it, p99 TPOT) and at least `MIN_FINISHED` of
the requests must finish.

`search` is a bracketing search on one running server (no restart between its replays): the multiplier grows
geometrically from `start` while the SLOs hold (or shrinks while they fail) until one probe holds and another
fails, then the bracket is bisected geometrically until its ends are within `rel_tol` of each other, all within
`max_replays` replays. The capacity is the largest multiplier that held, in requests/s the multiplier times the
workload's own rate. When even `MAX_MULTIPLIER` holds (the whole replay meets the SLOs as one batch) the search
stops there, unbracketed: the capacity is at least that. Any backend that can replay a request list on a config
serves (`Replayer`): the vLLM backend (`tuner.vllm.backend`), a live kvpilot engine (`tuner.live`), and the
simulators (`tuner.backends`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import workload as W
from tuner.metrics import SLO, TrialMetrics

MIN_FINISHED = 0.99  # share of the replayed requests that must finish
MAX_REPLAYS = 20  # one search's bound: each replay is the whole workload, time-compressed
MIN_MULTIPLIER = 1 / 64  # below this the config serves (almost) none of the traffic: capacity 0
MAX_MULTIPLIER = 256.0  # past this the replay is one batch: a workload this short cannot say more ("at least")


class Replayer(Protocol):
    """A backend that replays a request list (with its prompts' token ids) on a config and reads the metrics back."""

    def measure_requests(
        self, config: Any, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics: ...


@dataclass(frozen=True)
class Probe:
    multiplier: float
    holds: bool
    breaches: tuple[str, ...]  # which SLOs failed, with the figures
    metrics: TrialMetrics


@dataclass
class Capacity:
    """One search's answer: `multiplier` (0 when no probe held) and the probes that led to it, in order."""

    rate_rps: float  # the workload's own arrival rate
    multiplier: float = 0.0
    upper: float | None = None  # the smallest multiplier that failed (None: never bracketed from above)
    probes: list[Probe] = field(default_factory=list)

    @property
    def capacity_rps(self) -> float:
        return self.multiplier * self.rate_rps

    @property
    def bracketed(self) -> bool:
        return self.multiplier > 0 and self.upper is not None

    @property
    def found(self) -> bool:
        """A capacity, not a bound: bracketed, or 0 because the smallest multiplier failed. Not found: the SLOs
        still held at the largest multiplier tried (a lower bound), or failed at every one tried above the
        smallest (the search's budget ended first)."""
        if self.multiplier > 0:
            return self.upper is not None
        return any(not p.holds and p.multiplier <= MIN_MULTIPLIER for p in self.probes)

    @property
    def goodput_at_rate_tps(self) -> float | None:
        """Goodput at the recorded rate (multiplier 1), when the search probed it."""
        return next((p.metrics.goodput_tps for p in self.probes if p.multiplier == 1.0), None)

    def summary(self) -> dict[str, Any]:
        return {
            "capacity_rps": round(self.capacity_rps, 4),
            "multiplier": round(self.multiplier, 4),
            "upper": None if self.upper is None else round(self.upper, 4),
            "rate_rps": round(self.rate_rps, 4),
            "goodput_at_rate_tps": self.goodput_at_rate_tps,
            "replays": len(self.probes),
            "probes": [
                {"multiplier": round(p.multiplier, 4), "holds": p.holds, "breaches": list(p.breaches)}
                for p in self.probes
            ],
        }


def breaches(m: TrialMetrics, slo: SLO) -> tuple[str, ...]:
    """The SLOs `m` misses: p99 TTFT (user-facing) over its limit, p99 TPOT over the TPOT SLO, too few finished."""
    ttft_limit = slo.p99_ttft_s if slo.p99_ttft_s is not None else slo.ttft_s
    out = []
    if m.ttft_p99_s is None or m.ttft_p99_s > ttft_limit:
        out.append(f"p99 TTFT {_s(m.ttft_p99_s)} > {ttft_limit:g} s")
    if m.tpot_p99_s is not None and m.tpot_p99_s > slo.tpot_s:
        out.append(f"p99 TPOT {_s(m.tpot_p99_s)} > {slo.tpot_s:g} s")
    if m.requests == 0 or m.finished < MIN_FINISHED * m.requests:
        out.append(f"{m.finished}/{m.requests} finished < {MIN_FINISHED:.0%}")
    return tuple(out)


def _s(v: float | None) -> str:
    return "none" if v is None else f"{v:.3g} s"


def arrival_rate(reqs: Sequence[W.WorkloadRequest]) -> float:
    """Requests/s of the workload as recorded: its requests over the span of its arrivals."""
    if len(reqs) < 2:
        raise ValueError(f"capacity: a workload of {len(reqs)} request(s) has no arrival rate")
    arrivals = [r.arrival_s for r in reqs]
    span = max(arrivals) - min(arrivals)
    if span <= 0:
        raise ValueError("capacity: every request arrives at once (an offline batch has no arrival rate)")
    return (len(reqs) - 1) / span


def compress(reqs: Sequence[W.WorkloadRequest], multiplier: float) -> list[W.WorkloadRequest]:
    """The same requests arriving `multiplier` times as fast (the gaps divided by it, bursts kept)."""
    if not multiplier > 0:
        raise ValueError(f"multiplier: must be positive, got {multiplier}")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / multiplier) for r in reqs]


def search(
    measure: Callable[[float], TrialMetrics],
    *,
    rate_rps: float,
    slo: SLO,
    start: float = 1.0,
    growth: float = 2.0,
    rel_tol: float = 0.05,
    max_replays: int = 8,
) -> Capacity:
    """The bracketing search (module docstring); `measure(multiplier)` replays the workload compressed by it."""
    if not 1 <= max_replays <= MAX_REPLAYS:
        raise ValueError(f"max_replays: must be within 1..{MAX_REPLAYS}, got {max_replays}")
    if not growth > 1 or not rel_tol > 0 or not start > 0 or not rate_rps > 0:
        raise ValueError("capacity search: growth > 1, rel_tol > 0, start > 0 and a positive rate")
    out = Capacity(rate_rps=rate_rps)
    low: float | None = None  # the largest multiplier that held
    m = start
    while len(out.probes) < max_replays:
        metrics = measure(m)
        missed = breaches(metrics, slo)
        out.probes.append(Probe(m, not missed, missed, metrics))
        if not missed:
            low = m if low is None else max(low, m)
        else:
            out.upper = m if out.upper is None else min(out.upper, m)
        if low is not None and out.upper is not None:
            if out.upper / low <= 1 + rel_tol:
                break
            m = math.sqrt(low * out.upper)
        elif low is not None:
            m = low * growth
            if m > MAX_MULTIPLIER:
                break
        else:
            m = m / growth
            if m < MIN_MULTIPLIER:
                break
    out.multiplier = low or 0.0
    return out


def replay_capacity(
    backend: Replayer,
    config: Any,
    reqs: list[W.WorkloadRequest],
    prompts: list[list[int]],
    *,
    slo: SLO,
    run_id: str,
    start: float = 1.0,
    growth: float = 2.0,
    rel_tol: float = 0.05,
    max_replays: int = 8,
) -> Capacity:
    """`config`'s capacity on `backend` for the workload `reqs` (its rate: `arrival_rate`), one server throughout."""

    def measure(multiplier: float) -> TrialMetrics:
        tag = f"{run_id}-x{multiplier:.4g}"
        return backend.measure_requests(config, compress(reqs, multiplier), prompts, run_id=tag)

    return search(
        measure,
        rate_rps=arrival_rate(reqs),
        slo=slo,
        start=start,
        growth=growth,
        rel_tol=rel_tol,
        max_replays=max_replays,
    )
