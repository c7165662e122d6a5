"""Traps seen in KV memory: swap thrashing and the memory wall.

Each reads the best source the instance has: kvpilot's allocation trace and sample gauges, step rows
(kvpilot's step events or vLLM's iteration log), scraped series (vLLM's /metrics). Scraped series carry
no run id, so with a run filter only the engine's own events count. A source that is missing is never
read as zero: without any, the finding says "not enough data".
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select

from collector.queries._base import Db, _bound, _dialect, bucket_expr
from collector.queries.diagnosis_base import (
    EXAMPLES,
    FRAG_AT_USAGE,
    FRAG_HIGH,
    KV_FULL,
    KV_FULL_SHARE,
    SWAP_RATE,
    SWAP_SUSTAIN_S,
    Finding,
    Points,
    finding,
    no_data,
    request_dicts,
    request_rows,
    step_rows,
    study_hours,
    thin,
    versus,
)
from collector.queries.diagnosis_traffic import duration_s, in_flight_spans, inside
from collector.queries.timeseries import increase_of, series_points
from collector.schema import AllocRow, SampleRow, StepRow

SWAP_KNOB = "scheduler.preemption_mode"
WALL_KNOB = "scheduler.max_num_seqs"
FRAG_KNOB = "block_policy"


def _alloc_conds(instance: str, start: float, end: float, run_id: str | None) -> list[Any]:
    a = AllocRow.__table__.c
    conds = [a.instance == instance, a.ts >= start, a.ts < end]
    if run_id is not None:
        conds.append(a.run_id == run_id)
    return conds


def _gauge(db: Db, name: str, column: str, *, instance: str, start: float, end: float, run_id: str | None) -> Points:
    """A gauge's points for one instance: every source (samples, scrapes) without a run filter, else the
    engine's samples of that run. Several label sets (GPUs) are kept as separate points."""
    if run_id is None:
        series = series_points(db, name=name, start=start, end=end, instances=[instance])
        return sorted(p for points in series.values() for p in points)
    s = SampleRow.__table__.c
    stmt = select(s.ts, s[column]).where(
        s.instance == instance, s.run_id == run_id, s.ts >= start, s.ts < end, s[column].is_not(None)
    )
    with _bound(db) as conn:
        return sorted((float(ts), float(v)) for ts, v in conn.execute(stmt))


def _bucket_avg(points: Points, width: float) -> Points:
    acc: dict[float, list[float]] = defaultdict(list)
    for ts, v in points:
        acc[(ts // width) * width].append(v)
    return [(b, sum(vs) / len(vs)) for b, vs in sorted(acc.items())]


def _swap_rates(db: Db, *, instance: str, start: float, end: float, run_id: str | None) -> tuple[str, Points] | None:
    """(source, swaps/s per SWAP_SUSTAIN_S window): the allocation trace, else the swap-rate gauge, else the
    scraped swap counter; None where the instance has none of them."""
    a = AllocRow.__table__.c
    conds = _alloc_conds(instance, start, end, run_id)
    with _bound(db) as conn:
        traced = conn.execute(select(func.count()).select_from(AllocRow.__table__).where(*conds)).scalar_one()
        if traced:
            b = bucket_expr(a.ts, SWAP_SUSTAIN_S, _dialect(conn)).label("b")
            stmt = select(b, func.count()).where(*conds, a.op.in_(("swap_out", "swap_in"))).group_by(b).order_by(b)
            swaps = {float(t): n for t, n in conn.execute(stmt)}
            lo, hi = (start // SWAP_SUSTAIN_S) * SWAP_SUSTAIN_S, end
            grid = [lo + k * SWAP_SUSTAIN_S for k in range(int((hi - lo) // SWAP_SUSTAIN_S) + 1)]
            return "allocation trace", [(t, swaps.get(t, 0) / SWAP_SUSTAIN_S) for t in grid if t < hi]
    gauge = _gauge(db, "swap_rate", "swap_rate", instance=instance, start=start, end=end, run_id=run_id)
    if gauge:
        return "swap-rate gauge", _bucket_avg(gauge, SWAP_SUSTAIN_S)
    if run_id is None:
        counters = series_points(db, name="swaps_total", start=start, end=end, instances=[instance])
        per_bucket: dict[float, float] = defaultdict(float)
        for points in counters.values():  # one label set per direction: rates add up
            rates = [
                ((t1, (v1 - v0 if v1 >= v0 else v1) / (t1 - t0)))
                for (t0, v0), (t1, v1) in itertools.pairwise(points)
                if t1 > t0
            ]
            for bucket, v in _bucket_avg(rates, SWAP_SUSTAIN_S):
                per_bucket[bucket] += v
        if per_bucket:
            return "scraped swap counter", sorted(per_bucket.items())
    return None


def swap_thrashing(
    db: Db, *, instance: str, start: float, end: float, run_id: str | None = None, now: float | None = None
) -> Finding:
    """Swaps (out + in) above 100/s averaged over a 10-s window.

    Cost: the time requests spent swapped out to the host tier (`swap_s`, part of their latency), per
    swapped request; vLLM's spans carry no swap time, so there the cost is not estimated.
    """
    trap = "swap_thrashing"
    found = _swap_rates(db, instance=instance, start=start, end=end, run_id=run_id)
    if found is None:
        why = (
            "no allocation trace, swap-rate gauge or scraped swap counter for this instance "
            "(kvpilot: telemetry.trace_alloc or sample events; vLLM v1 does not swap)"
        )
        return no_data(trap, instance, why, knob=SWAP_KNOB)
    source, rates = found
    above = [(t, v) for t, v in rates if v > SWAP_RATE]
    peak = max((v for _, v in rates), default=0.0)
    with _bound(db) as conn:
        rows, _ = request_rows(
            conn,
            instance=instance,
            start=start,
            end=end,
            run_id=run_id,
            columns=("request_id", "ts", "swaps", "swap_s", "preemptions", "e2e_s"),
        )
    swapped = [r for r in rows if r.swaps > 0]
    swap_total = sum(r.swap_s for r in swapped)
    present = bool(above)
    if present:
        summary = (
            f"Swapping above {SWAP_RATE:g}/s for {len(above) * SWAP_SUSTAIN_S:g} s of the window (peak "
            f"{peak:.0f}/s over {SWAP_SUSTAIN_S:g} s, from the {source}); {len(swapped)} requests were swapped."
        )
    else:
        against = versus(peak, SWAP_RATE, f"{SWAP_RATE:g}/s", "thrashing threshold")
        summary = (
            f"No thrashing: swaps peaked at {peak:.1f}/s over {SWAP_SUSTAIN_S:g} s, {against} (from the {source})."
        )
    if swapped and swap_total > 0:
        per_request = swap_total / len(swapped)
        cost_value: float | None = per_request
        cost = (
            f"Latency: {len(swapped)} swapped requests spent {swap_total:.2f} s swapped out in all, "
            f"{per_request * 1e3:.0f} ms each on average (their swap_s, counted inside prefill/decode)."
        )
    elif swapped or not rows:
        cost_value, cost = None, "Not estimated: no per-request swap time is stored for this instance."
    else:
        cost_value, cost = 0.0, "None: no request of the window was swapped."
    worst = sorted(swapped, key=lambda r: (-r.swap_s, -r.swaps))[:EXAMPLES]
    return finding(
        trap,
        instance,
        present=present,
        summary=summary,
        knob=SWAP_KNOB,
        hours=study_hours(start, now or time.time()),
        severity="critical" if peak >= 5 * SWAP_RATE else "warning",
        evidence={
            "source": source,
            "peak_swaps_per_s": peak,
            "seconds_above": len(above) * SWAP_SUSTAIN_S,
            "windows": len(rates),
            "swapped_requests": len(swapped),
            "swap_s_total": swap_total,
        },
        series={f"swaps/s ({SWAP_SUSTAIN_S:g}-s average)": thin(rates)},
        requests=request_dicts(worst),
        cost=cost,
        cost_value=cost_value,
        cost_unit="s swapped per swapped request",
    )


def _preemptions(db: Db, *, instance: str, start: float, end: float, run_id: str | None, from_requests: int) -> int:
    """Preemptions in the window: the largest count of requests, steps and the scraped counter (a source
    that does not record them reports 0, e.g. vLLM's spans)."""
    st = StepRow.__table__.c
    conds = [st.instance == instance, st.ts >= start, st.ts < end, st.warmup.is_(False)]
    if run_id is not None:
        conds.append(st.run_id == run_id)
    with _bound(db) as conn:
        from_steps = conn.execute(select(func.coalesce(func.sum(st.preemptions), 0)).where(*conds)).scalar_one()
    counts = [from_requests, int(from_steps)]
    if run_id is None:
        scraped = series_points(db, name="preemptions_total", start=start, end=end, instances=[instance])
        counts.append(int(sum(increase_of(points) for points in scraped.values())))
    return max(counts)


def _wall_cost(recomputed_tps: float, preempted: int, preemptions: int, ooms: int) -> str:
    failed = f"; {ooms} allocation(s) failed" if ooms else ""
    if preempted:
        return (
            f"Throughput: at least {recomputed_tps:.1f} prompt tokens/s recomputed for {preempted} preempted "
            f"requests (preemptions x prompt tokens over the window; their generated tokens come on top){failed}."
        )
    if preemptions:
        return (
            f"Not estimated: {preemptions} preemption(s) counted (steps or scrapes), but no request row says which "
            f"requests were preempted or how long they were{failed}."
        )
    return f"No preemption recorded in the window, so nothing was recomputed{failed}."


def memory_wall(
    db: Db, *, instance: str, start: float, end: float, run_id: str | None = None, now: float | None = None
) -> Finding:
    """KV usage at the wall: full for a share of the window, failed allocations, preemptions when full, or
    fragmentation high while usage is high.

    KV usage comes from the kv_usage gauge (kvpilot samples, vLLM scrapes), else from step rows (used /
    total blocks, kvpilot's steps or vLLM's iteration log). Cost: the prompt tokens preempted requests had
    to recompute, per second of the window (a lower bound: their generated tokens are recomputed too).
    """
    trap = "memory_wall"
    usage = _gauge(db, "kv_usage", "kv_usage", instance=instance, start=start, end=end, run_id=run_id)
    source = "kv_usage gauge"
    if not usage:
        with _bound(db) as conn:
            steps = step_rows(
                conn,
                instance=instance,
                start=start,
                end=end,
                run_id=run_id,
                columns=("kv_blocks_used", "kv_blocks_total"),
            )
        usage = [(s.ts, s.kv_blocks_used / s.kv_blocks_total) for s in steps if s.kv_blocks_total > 0]
        source = "step rows (used / total KV blocks)"
    if not usage:
        why = "no KV usage gauge (samples or scrapes) and no step rows for this instance"
        return no_data(trap, instance, why, knob=WALL_KNOB)
    frag = _gauge(db, "kv_fragmentation", "fragmentation", instance=instance, start=start, end=end, run_id=run_id)
    with _bound(db) as conn:
        ooms = conn.execute(
            select(func.count())
            .select_from(AllocRow.__table__)
            .where(*_alloc_conds(instance, start, end, run_id), AllocRow.__table__.c.op == "oom")
        ).scalar_one()
        rows, _ = request_rows(
            conn,
            instance=instance,
            start=start,
            end=end,
            run_id=run_id,
            columns=("request_id", "ts", "status", "prompt_tokens", "output_tokens", "preemptions", "e2e_s"),
            statuses=None,
        )
    preempted = [r for r in rows if r.preemptions > 0]
    preemptions = _preemptions(
        db, instance=instance, start=start, end=end, run_id=run_id, from_requests=sum(r.preemptions for r in rows)
    )
    # Samples taken in an idle gap (no request arriving or in flight) would dilute the full share and the
    # means: with request rows, only the samples with traffic count (all of them where none falls in it).
    # The peak is over every sample: leaving samples out can only hide one.
    traffic = in_flight_spans(rows)
    busy, busy_frag = inside(traffic, usage), inside(traffic, frag)
    idle_samples = len(usage) - len(busy) if busy else 0
    values = [v for _, v in busy or usage]
    full_share = sum(v >= KV_FULL for v in values) / len(values)
    peak, mean = max(v for _, v in usage), sum(values) / len(values)
    frag_values = [v for _, v in busy_frag or frag]
    frag_mean = sum(frag_values) / len(frag_values) if frag_values else None
    fragmented = frag_mean is not None and frag_mean >= FRAG_HIGH and peak >= FRAG_AT_USAGE
    sampled = "samples with traffic" if busy else "samples"
    reasons = [
        *([f"KV usage >= {KV_FULL:.0%} in {full_share:.0%} of the {sampled}"] if full_share >= KV_FULL_SHARE else []),
        *([f"{ooms} failed KV allocation(s)"] if ooms else []),
        *([f"{preemptions} preemption(s) with usage peaking at {peak:.0%}"] if preemptions and peak >= KV_FULL else []),
        *([f"fragmentation averaging {frag_mean:.0%} with usage up to {peak:.0%}"] if fragmented else []),
    ]
    present = bool(reasons)
    if present:
        summary = "At the wall: " + "; ".join(reasons) + "."
    else:
        full = versus(full_share, KV_FULL_SHARE, f"{KV_FULL_SHARE:.0%}", "wall threshold")
        summary = (
            f"KV usage peaked at {peak:.0%} (mean {mean:.0%}), {versus(peak, KV_FULL, f'{KV_FULL:.0%}', 'full level')}"
            + (f"; full in {full_share:.0%} of the {sampled}, {full}" if full_share else "")
            + "; no failed allocations"
            + (f", {preemptions} preemption(s)." if preemptions else ", no preemptions.")
        )
    # A rate per second of the time with traffic (an idle gap is not a second of serving); the window
    # where no request row says when traffic was.
    window_s = duration_s(traffic) if duration_s(traffic) > 0 else end - start
    recomputed = sum(r.preemptions * r.prompt_tokens for r in preempted)
    worst = sorted(preempted, key=lambda r: (-r.preemptions, -r.e2e_s))[:EXAMPLES]
    series = {"KV usage": thin(usage)}
    if frag:
        series["fragmentation"] = thin(frag)
    return finding(
        trap,
        instance,
        present=present,
        summary=summary,
        knob=FRAG_KNOB if fragmented and len(reasons) == 1 else WALL_KNOB,
        hours=study_hours(start, now or time.time()),
        severity="critical" if ooms or full_share >= 0.5 else "warning",
        evidence={
            "source": source,
            "samples": len(values),
            "idle_samples_left_out": idle_samples,
            "traffic_s": duration_s(traffic),
            "full_share": full_share,
            "usage_peak": peak,
            "usage_mean": mean,
            "fragmentation_mean": frag_mean,
            "failed_allocations": ooms,
            "preemptions": preemptions,
            "preempted_requests": len(preempted),
        },
        series=series,
        requests=request_dicts(worst),
        cost=_wall_cost(recomputed / window_s, len(preempted), preemptions, ooms),
        cost_value=recomputed / window_s if preempted else None,
        cost_unit="prompt tokens/s recomputed",
    )
