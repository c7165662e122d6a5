"""What the trap detectors share: the `Finding`, the seed's thresholds, the knob of each trap and its study.

A detector looks at one instance over one window and answers one of three things: the trap is there (with
the series and requests that show it, and what it costs), it is not, or the stored data cannot tell
("not enough data", never a false "fine"). The thresholds are the seed's numbers, named here once.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.engine import Row

from collector.queries.request_stats import _request_filter
from collector.schema import RequestRow, StepRow
from plumbing.percentile import nearest_rank

Status = Literal["present", "absent", "no_data"]
Severity = Literal["critical", "warning", "ok", "unknown"]
Points = list[tuple[float, float]]

# --- the seed's thresholds -------------------------------------------------------------------------------
MIN_REQUESTS = 50  # fewer finished requests in the window: request-based checks say "not enough data"
MAX_ROWS = 200_000  # request rows read per check at most (the newest); the evidence says when it was cut
MAX_POINTS = 600  # points per evidence series; thinned by keeping each bucket's peak
EXAMPLES = 10  # requests listed as evidence
IDLE_GAP_S = 10.0  # this long without a request is an idle gap, left out of rates and baselines
NEAR = 0.8  # a figure at 80% of its threshold or more (still under it) is reported as "just under" it

# Short and long requests mixed (15-25% compute lost): a wide spread of prompt sizes, and short requests
# that waited for a long prefill wait clearly longer than short requests that did not.
LENGTH_SPREAD = 8.0  # p90 / p10 of prompt tokens
HOL_RATIO = 2.0  # short requests behind a long prefill: time to prefill done >= 2x the others'
HOL_MIN_S = 0.010  # ... and at least 10 ms more
MIN_BLOCKED = 5  # short requests behind a long prefill, at least

# Bursts of 300%+ the scheduler cannot absorb (50 ms+ delays).
BURST_RATIO = 4.0  # arrivals in a 1-s window >= 4x the window's median per second (+300%)
BURST_MIN_ARRIVALS = 4  # ... and at least this many (a 0 -> 1 second is not a burst)
BURST_QUEUE_S = 0.050  # median queue time of the burst's arrivals

# Swap thrashing (> 100 swaps/s).
SWAP_RATE = 100.0  # swaps (out + in) per second
SWAP_SUSTAIN_S = 10.0  # averaged over 10-s windows: one busy second is not thrashing

# Cold start (first 100 requests at 2x latency).
COLD_N = 100  # the first requests of a run (after the engine's own warm-up requests)
COLD_RATIO = 2.0  # their median latency >= 2x the rest's
COLD_MIN_REST = 50  # requests after the first COLD_N needed to compare with

# The memory wall (KV usage near full, fragmentation).
KV_FULL = 0.95  # KV usage at or above this is full
KV_FULL_SHARE = 0.10  # share of the window's KV samples that are full
FRAG_HIGH = 0.25  # mean fragmentation (free KV memory unusable for a block) ...
FRAG_AT_USAGE = 0.80  # ... while KV usage peaked at least this high


@dataclass(frozen=True)
class Knob:
    """A config knob a finding points at: why it helps, vLLM's equivalent, and a study's size."""

    name: str
    why: str
    vllm: str
    trials: int = 12
    tunable: bool = True  # hot-reloadable, in tuner/space.yml: a study can search it


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "scheduler.prefill_chunk_tokens",
            "chunked prefill cuts a long prompt into steps, so short requests and decodes run between its chunks",
            "--enable-chunked-prefill with --long-prefill-token-threshold / --max-num-batched-tokens",
            trials=10,
        ),
        Knob(
            "scheduler.max_num_batched_tokens",
            "a larger token budget per step prefills more of a burst's queued prompts at once",
            "--max-num-batched-tokens",
            trials=10,
        ),
        Knob(
            "scheduler.preemption_mode",
            "recompute instead of swap: a preempted sequence is recomputed rather than copied out and back",
            "vLLM v1 always recomputes; lower --max-num-seqs or raise --gpu-memory-utilization",
            trials=4,
        ),
        Knob(
            "scheduler.max_num_seqs",
            "fewer sequences at once leave each its KV blocks, so none is preempted for another's growth",
            "--max-num-seqs (and --gpu-memory-utilization for a larger KV pool)",
            trials=12,
        ),
        Knob(
            "block_policy",
            "block size and policy set how much free KV memory is left in pieces too small for a block",
            "--block-size",
            trials=12,
        ),
        Knob(
            "warmup.requests",
            "warm-up requests at start-up pay the compile and allocation costs before real traffic does",
            "send a few warm-up requests before routing traffic (vLLM warms its CUDA graphs only)",
            tunable=False,
        ),
    )
}


@dataclass(frozen=True)
class Trap:
    key: str
    title: str
    seed: str  # the trap as the seed names it
    rule: str  # the check, with the thresholds above


TRAPS: dict[str, Trap] = {
    t.key: t
    for t in (
        Trap(
            "mixed_lengths",
            "Short and long requests mixed",
            "short and long requests in one batch: 15-25% of compute lost",
            f"prompt tokens p90/p10 >= {LENGTH_SPREAD:g}, and short requests (<= median prompt) whose wait for "
            f"their prefill overlapped a long prefill (>= p90 prompt) waited >= {HOL_RATIO:g}x the other short "
            f"requests and >= {HOL_MIN_S * 1e3:g} ms more (at least {MIN_BLOCKED} of them)",
        ),
        Trap(
            "bursts",
            "Bursts the scheduler cannot absorb",
            "arrival bursts of 300%+ that the scheduler cannot absorb: 50 ms+ delays",
            f"a 1-s window with >= {BURST_RATIO:g}x the median arrivals per second (and >= {BURST_MIN_ARRIVALS}), "
            f"whose arrivals waited a median >= {BURST_QUEUE_S * 1e3:g} ms in the queue",
        ),
        Trap(
            "swap_thrashing",
            "Swap thrashing",
            "KV swapping between device and host: > 100 swaps/s",
            f"swaps (out + in) above {SWAP_RATE:g}/s averaged over a {SWAP_SUSTAIN_S:g}-s window",
        ),
        Trap(
            "cold_start",
            "Cold start",
            "the first 100 requests of a run at 2x latency",
            f"the first {COLD_N} requests of a run that started in the window (engine warm-up excluded) have a "
            f"median TTFT (e2e where TTFT is missing) >= {COLD_RATIO:g}x that of the rest (>= {COLD_MIN_REST})",
        ),
        Trap(
            "memory_wall",
            "The memory wall",
            "KV cache usage near full, fragmentation: preemptions and failed allocations",
            f"KV usage >= {KV_FULL:.0%} in >= {KV_FULL_SHARE:.0%} of the samples, or a failed KV allocation, or "
            f"preemptions at usage >= {KV_FULL:.0%}, or fragmentation >= {FRAG_HIGH:.0%} at usage >= "
            f"{FRAG_AT_USAGE:.0%}",
        ),
    )
}


@dataclass(frozen=True)
class Finding:
    """One trap on one instance over the window: whether it is there, the evidence, the cost and the knob.

    `evidence` holds the figures compared with the thresholds; `series` the series that show it (name ->
    [(ts, value)]); `requests` a few requests that show it, worst first. `cost` says what is lost and how it
    was estimated, `cost_value` is that estimate in `cost_unit` (None where the data cannot give one).
    `study_command` runs a tuning study over exactly `knob` (None for a knob no study can search) in the
    instance's engine's terms (`for_engine`).
    """

    trap: str
    instance: str
    status: Status
    severity: Severity
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    series: dict[str, Points] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    cost: str = ""
    cost_value: float | None = None
    cost_unit: str = ""
    knob: str = ""
    study_command: str | None = None
    engine: str | None = None  # the instance's engine ('kvpilot', 'vllm', ...; None: unknown), for the advice

    @property
    def present(self) -> bool:
        return self.status == "present"

    @property
    def title(self) -> str:
        return TRAPS[self.trap].title


def study_hours(start: float, now: float) -> float:
    """Hours back from `now` that the tuner's stored workload must read to include the window's start."""
    return float(max(1, math.ceil((now - start) / 3600.0)))


def study_name(trap: str, instance: str) -> str:
    """The study a finding's command starts: the Tuning page lists it under this name."""
    return f"diagnosis-{trap.replace('_', '-')}-{instance}"


def study_command(knob: str, *, trap: str, instance: str, hours: float) -> str | None:
    """`kvpilot tune study` over exactly `knob`, replaying the instance's own stored traffic (None: not tunable).

    The stored workload replays the last `hours` of the instance's requests at their recorded arrivals (the
    bursts a finding is about kept); `--knob` keeps the other knobs of the search space at the current config's
    values.
    """
    spec = KNOBS[knob]
    if not spec.tunable:
        return None
    args = [
        "kvpilot",
        "tune",
        "study",
        "--knob",
        knob,
        "--workload",
        "stored",
        "--instance",
        instance,
        "--hours",
        f"{hours:g}",
        "--trials",
        str(spec.trials),
        "--study-name",
        study_name(trap, instance),
    ]
    return shlex.join(args)


VLLM_CONFIG = "vllm-config.yaml"  # how the study command names the running vLLM's own --config file


def vllm_study_command(*, trap: str, instance: str, hours: float) -> str:
    """`kvpilot tune vllm study` replaying the instance's stored requests against vLLM's own arguments (its
    search space covers the flags KNOBS names for vLLM); `--config` is the running vLLM's config file."""
    args = ["kvpilot", "tune", "vllm", "study", "--config", VLLM_CONFIG, "--workload", f"stored:{instance}"]
    args += [
        "--instance",
        instance,
        "--hours",
        f"{hours:g}",
        "--study-name",
        study_name(trap, instance),
    ]
    return shlex.join(args)


def for_engine(found: Finding, engine: str | None, *, hours: float) -> Finding:
    """The finding's advice in its engine's terms: a vLLM instance gets the vLLM study of its own arguments
    (kvpilot's study searches kvpilot's config keys, which a vLLM does not read)."""
    command = found.study_command
    if engine == "vllm" and command is not None:
        command = vllm_study_command(trap=found.trap, instance=found.instance, hours=hours)
    return dataclasses.replace(found, engine=engine, study_command=command)


def finding(
    trap: str,
    instance: str,
    *,
    present: bool,
    summary: str,
    knob: str,
    hours: float,
    severity: Severity | None = None,
    **details: Any,
) -> Finding:
    """A checked finding (present or absent) with its knob and study command filled in."""
    return Finding(
        trap=trap,
        instance=instance,
        status="present" if present else "absent",
        severity=(severity or "warning") if present else "ok",
        summary=summary,
        knob=knob,
        study_command=study_command(knob, trap=trap, instance=instance, hours=hours),
        **details,
    )


def no_data(trap: str, instance: str, why: str, *, knob: str, **details: Any) -> Finding:
    return Finding(trap, instance, "no_data", "unknown", f"Not enough data: {why}", knob=knob, **details)


# --- small helpers ---------------------------------------------------------------------------------------


def versus(value: float, threshold: float, shown: str, name: str) -> str:
    """How a figure under its threshold stands: "just under the mixing threshold 8" when it is close (a
    reader should not read "alike" into 7.5 against 8), else "under the mixing threshold 8"."""
    return f"{'just under' if near(value, threshold) else 'under'} the {name} {shown}"


def near(value: float, threshold: float) -> bool:
    return NEAR * threshold <= value < threshold


def median(values: Sequence[float]) -> float:
    """The nearest-rank p50 (the read package's percentile definition); 0.0 without values."""
    return nearest_rank(values, 0.5) or 0.0


def thin(points: Points, max_points: int = MAX_POINTS, agg: Callable[[list[float]], float] = max) -> Points:
    """At most `max_points` points: equal-width buckets keep their peak (a burst must stay visible)."""
    if len(points) <= max_points:
        return points
    lo, hi = points[0][0], points[-1][0]
    width = (hi - lo) / max_points or 1.0
    buckets: dict[int, list[float]] = {}
    for ts, value in points:
        buckets.setdefault(min(max_points - 1, int((ts - lo) / width)), []).append(value)
    return [(lo + k * width, agg(vs)) for k, vs in sorted(buckets.items())]


def request_rows(
    conn: Any,
    *,
    instance: str,
    start: float,
    end: float,
    run_id: str | None,
    columns: Sequence[str],
    statuses: Sequence[str] | None = ("finished",),
) -> tuple[list[Row], bool]:
    """Request rows (engine warm-up excluded) sorted by arrival (`arrival` = ts - e2e_s), and whether
    MAX_ROWS cut them (the newest are kept)."""
    r = RequestRow.__table__.c
    stmt = (
        select((r.ts - r.e2e_s).label("arrival"), *(r[c] for c in columns))
        .where(*_request_filter(start, end, [instance], run_id, statuses, False))
        .order_by(r.ts.desc(), r.id.desc())
        .limit(MAX_ROWS + 1)
    )
    rows = conn.execute(stmt).all()
    truncated = len(rows) > MAX_ROWS
    rows = sorted(rows[:MAX_ROWS], key=lambda row: row.arrival)
    return rows, truncated


def step_rows(conn: Any, *, instance: str, start: float, end: float, run_id: str | None, columns: Sequence[str]):
    """Step rows (warm-up excluded) in time order, at most MAX_ROWS (the newest)."""
    s = StepRow.__table__.c
    conds = [s.instance == instance, s.ts >= start, s.ts < end, s.warmup.is_(False)]
    if run_id is not None:
        conds.append(s.run_id == run_id)
    stmt = select(s.ts, *(s[c] for c in columns)).where(*conds).order_by(s.ts.desc(), s.id.desc()).limit(MAX_ROWS)
    return sorted(conn.execute(stmt).all(), key=lambda row: row.ts)


def request_dicts(rows: Sequence[Row], extra: dict[str, Sequence[Any]] | None = None) -> list[dict[str, Any]]:
    """Rows as plain dicts (with optional extra columns, one value per row) for `Finding.requests`."""
    out = [dict(row._mapping) for row in rows]
    for name, values in (extra or {}).items():
        for d, v in zip(out, values, strict=True):
            d[name] = v
    return out
