"""A trial's measured metrics, read back from the collector's database (the dashboard's own queries).

The trial's events are stored through the collector's ingest path (validation, one transaction per
batch, idempotency key per trial and chunk) under the trial's run id; the objective is then computed
with `collector.queries` over the trial's window: the same figures, from the same functions, as the
dashboard and the rules show. TTFT and e2e, the SLOs' figures, are the user-facing ones
(`collector.queries.headline_latency`: from the HTTP arrival, the stage before the engine included).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import Engine

from collector.ingest import parse_batch, store_batch
from collector.queries import alloc_trace, goodput, headline_latency, latency_percentiles, request_rates
from engine.events import event_to_json
from engine.sinks import AnyEvent

log = logging.getLogger("kvpilot.tuner.metrics")

CHUNK_EVENTS = 10_000


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1
    p99_e2e_s: float | None = None  # constraint: p99 end-to-end latency within this
    max_rejection_rate: float = 0.01  # constraint: share of requests refused at admission
    max_oom: int = 0  # constraint: KV allocations that failed (forced preemptions) per trial
    p99_ttft_s: float | None = None  # constraint on p99 TTFT; None: the TTFT SLO
    # the p99 TTFT and end-to-end constraints apply; off past capacity (`past_capacity`)
    tails: bool = True

    @property
    def p99_ttft_limit_s(self) -> float:
        """The limit p99 TTFT is held to: `p99_ttft_s`, or the TTFT SLO itself when none is set."""
        return self.p99_ttft_s if self.p99_ttft_s is not None else self.ttft_s

    def past_capacity(self) -> SLO:
        """The SLO for a replay past the running config's capacity (the screen's objective): such a replay
        breaks the p99 latency constraints by construction, so only the others constrain it, and goodput (the
        requests still within the TTFT and TPOT SLOs) ranks the configs."""
        return dataclasses.replace(self, tails=False)

    def validate(self) -> SLO:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.max_rejection_rate <= 1:
            raise ValueError(f"max_rejection_rate: must be within [0, 1], got {self.max_rejection_rate}")
        if self.max_oom < 0:
            raise ValueError(f"max_oom: must be >= 0, got {self.max_oom}")
        if self.p99_ttft_s is not None and not self.p99_ttft_s > 0:
            raise ValueError(f"p99_ttft_s: must be positive, got {self.p99_ttft_s}")
        return self


@dataclass(frozen=True)
class TrialMetrics:
    run_id: str
    window_s: float
    requests: int
    finished: int
    rejected: int
    failed: int
    throughput_tps: float  # output tokens/s of finished requests
    goodput_tps: float  # output tokens/s of requests meeting the TTFT and TPOT SLOs
    goodput_rps: float
    good_fraction: float
    rejection_rate: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    oom: int
    preemptions: int
    held_back: int = 0  # requests the replay client held until the server answered one of its in-flight bound

    def constraints(self, slo: SLO) -> dict[str, float]:
        """Optuna constraint values: feasible when every value is <= 0."""
        p99_ttft_limit = slo.p99_ttft_limit_s
        out = {
            "oom": float(self.oom - slo.max_oom),
            "rejection": self.rejection_rate - slo.max_rejection_rate,
        }
        if slo.tails:
            out["p99_ttft"] = (self.ttft_p99_s if self.ttft_p99_s is not None else 1e9) - p99_ttft_limit
        if slo.tails and slo.p99_e2e_s is not None:
            out["p99_e2e"] = (self.e2e_p99_s if self.e2e_p99_s is not None else 1e9) - slo.p99_e2e_s
        if self.finished == 0:
            out["finished"] = 1.0
        return out

    def feasible(self, slo: SLO) -> bool:
        return all(v <= 0 for v in self.constraints(slo).values())

    def as_dict(self) -> dict:
        return asdict(self)


def combine(runs: Sequence[TrialMetrics]) -> TrialMetrics:
    """One trial measured on several workload seeds: rates averaged, counts summed, tails the worst."""
    if len(runs) == 1:
        return runs[0]

    def mean(name: str) -> float:
        return sum(getattr(m, name) for m in runs) / len(runs)

    def worst(name: str) -> float | None:
        values = [getattr(m, name) for m in runs if getattr(m, name) is not None]
        return max(values) if values else None

    requests = sum(m.requests for m in runs)
    rejected = sum(m.rejected for m in runs)
    return TrialMetrics(
        run_id=",".join(m.run_id for m in runs),
        window_s=sum(m.window_s for m in runs),
        requests=requests,
        finished=sum(m.finished for m in runs),
        rejected=rejected,
        failed=sum(m.failed for m in runs),
        throughput_tps=mean("throughput_tps"),
        goodput_tps=mean("goodput_tps"),
        goodput_rps=mean("goodput_rps"),
        good_fraction=mean("good_fraction"),
        rejection_rate=rejected / requests if requests else 0.0,
        ttft_p50_s=worst("ttft_p50_s"),
        ttft_p99_s=worst("ttft_p99_s"),
        tpot_p99_s=worst("tpot_p99_s"),
        e2e_p50_s=worst("e2e_p50_s"),
        e2e_p99_s=worst("e2e_p99_s"),
        oom=max(m.oom for m in runs),
        preemptions=sum(m.preemptions for m in runs),
        held_back=sum(m.held_back for m in runs),
    )


def with_unrecorded(m: TrialMetrics, *, refused: int, lost: int) -> TrialMetrics:
    """`m` with the requests its rows never saw counted against the config: `refused` (answered 429/503 by a
    server that stores no row for them) and `lost` (failed on the wire, answered with an error, or answered but
    never stored) join the requests and the failed, and both the rejection rate (the constraint that refuses a
    config whose users were turned away or lost)."""
    if refused < 0 or lost < 0:
        raise ValueError(f"unrecorded: counts must be >= 0, got refused={refused}, lost={lost}")
    if not refused and not lost:
        return m
    total = m.requests + refused + lost
    return dataclasses.replace(
        m,
        requests=total,
        rejected=m.rejected + refused,
        failed=m.failed + lost,
        rejection_rate=(m.rejected + refused + lost) / total,
        good_fraction=m.good_fraction * m.requests / total,
    )


def with_client_wait(m: TrialMetrics, *, held_back: int, wait_p99_s: float) -> TrialMetrics:
    """`m` with the wait of the requests the replay client held back (`held_back`, the server already held the
    client's bound of unanswered requests: `integrations.vllm.client`) before the server saw them. Each such
    request's TTFT as its user sees it is its wait plus the server's TTFT, so at least either; the p99 over the
    requests is then at least the p99 of the waits (0 for the requests that did not wait) and at least the server's
    p99. `ttft_p99_s` and `e2e_p99_s` become the larger of the two: a lower bound of what the users saw, never the
    server's smaller figure alone (the wait is not matched to the server's rows request by request)."""
    if held_back < 0 or wait_p99_s < 0:
        raise ValueError(f"client wait: must be >= 0, got held_back={held_back}, wait_p99_s={wait_p99_s}")
    if not held_back:
        return m

    def at_least(value: float | None) -> float:
        return wait_p99_s if value is None else max(value, wait_p99_s)

    return dataclasses.replace(
        m, held_back=m.held_back + held_back, ttft_p99_s=at_least(m.ttft_p99_s), e2e_p99_s=at_least(m.e2e_p99_s)
    )


def store_events(db: Engine, events: Sequence[AnyEvent], *, key_prefix: str) -> int:
    """Store events through the collector's ingest (validated, atomic per chunk, idempotent)."""
    stored = 0
    for i in range(0, len(events), CHUNK_EVENTS):
        chunk = events[i : i + CHUNK_EVENTS]
        body = json.dumps({"events": [event_to_json(e) for e in chunk]}, separators=(",", ":")).encode()
        batch = parse_batch(body, max_events=CHUNK_EVENTS)
        result = store_batch(db, batch, idempotency_key=f"{key_prefix}-{i // CHUNK_EVENTS}", content=body)
        stored += result.events
    return stored


def trial_metrics(
    db: Engine,
    *,
    run_id: str | None,
    start: float,
    end: float,
    slo: SLO,
    instances: Sequence[str] | None = None,
) -> TrialMetrics:
    """The objective's inputs for one trial window. `run_id` None (live backend): every run of the
    instances in the window."""
    end = max(end, start + 1e-6)
    window = end - start
    rates = request_rates(db, start=start, end=end, group_by="all", run_id=run_id, instances=instances)
    good = goodput(
        db,
        start=start,
        end=end,
        ttft_slo_s=slo.ttft_s,
        tpot_slo_s=slo.tpot_s,
        group_by="all",
        run_id=run_id,
        instances=instances,
    )
    tpot = latency_percentiles(
        db, start=start, end=end, metric="tpot", quantiles=(0.99,), group_by="all", run_id=run_id, instances=instances
    )
    headline = headline_latency(db, start=start, end=end, run_id=run_id, instances=instances)
    rr = rates[0] if rates else None
    gg = good[0] if good else None
    tokens = gg.good_output_tokens if gg else 0
    preempt = rr.preemptions if rr else 0
    oom = alloc_trace(db, start=start, end=end, limit=0, run_id=run_id, instances=instances, ops=("oom",)).total

    requests = rr.requests if rr else 0
    return TrialMetrics(
        run_id=run_id or "*",
        window_s=window,
        requests=requests,
        finished=rr.finished if rr else 0,
        rejected=rr.rejected if rr else 0,
        failed=rr.failed if rr else 0,
        throughput_tps=rr.output_tokens_per_s if rr else 0.0,
        goodput_tps=tokens / window,
        goodput_rps=gg.good_per_s if gg else 0.0,
        good_fraction=gg.fraction if gg else 0.0,
        rejection_rate=(rr.rejected / requests) if rr and requests else 0.0,
        ttft_p50_s=headline.ttft_p50_s,
        ttft_p99_s=headline.ttft_p99_s,
        tpot_p99_s=tpot[0].quantiles.get(0.99) if tpot else None,
        e2e_p50_s=headline.e2e_p50_s,
        e2e_p99_s=headline.e2e_p99_s,
        oom=oom,
        preemptions=preempt,
    )
