"""Traps seen in request rows: short and long requests mixed, bursts, cold start.

Request rows have one shape whatever their source (kvpilot's events, vLLM's `llm_request` spans), so these
checks work for both; arrival is `ts - e2e_s`. Engine warm-up requests are left out throughout.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter

from sqlalchemy import func, select

from collector.queries._base import Db, _bound
from collector.queries.diagnosis_base import (
    BURST_MIN_ARRIVALS,
    BURST_QUEUE_S,
    BURST_RATIO,
    COLD_MIN_REST,
    COLD_N,
    COLD_RATIO,
    EXAMPLES,
    HOL_MIN_S,
    HOL_RATIO,
    LENGTH_SPREAD,
    MAX_ROWS,
    MIN_BLOCKED,
    MIN_REQUESTS,
    Finding,
    finding,
    median,
    near,
    no_data,
    request_dicts,
    request_rows,
    step_rows,
    study_hours,
    thin,
    versus,
)
from collector.queries.diagnosis_traffic import WAIT_COLUMNS, arrival_spans, seconds_of, waited_s
from collector.queries.request_stats import _request_filter
from collector.schema import RequestRow
from plumbing.percentile import nearest_rank

MIXED_KNOB = "scheduler.prefill_chunk_tokens"
BURST_KNOB = "scheduler.max_num_batched_tokens"
COLD_KNOB = "warmup.requests"


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlap(merged: list[tuple[float, float]], starts: list[float], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the merged (disjoint, sorted) intervals."""
    total = 0.0
    for a, b in merged[max(0, bisect.bisect_right(starts, lo) - 1) :]:
        if a >= hi:
            break
        total += max(0.0, min(b, hi) - max(a, lo))
    return total


def _decode_stall(steps: list, long_prompt: float) -> dict[str, float]:
    """How long decoding sequences waited in steps that carried a long prefill, beyond a pure-decode step."""
    pure = [s.duration_s for s in steps if s.prefill_tokens == 0 and s.decode_tokens > 0]
    decoding = [s for s in steps if s.decode_tokens > 0]
    if not pure or not decoding:
        return {}
    d0 = median(pure)
    stall = sum(max(0.0, s.duration_s - d0) for s in decoding if s.prefill_tokens >= long_prompt)
    busy = sum(s.duration_s for s in decoding)
    return {"pure_decode_step_s": d0, "decode_stall_s": stall, "decode_stall_share": stall / busy if busy else 0.0}


def mixed_lengths(
    db: Db, *, instance: str, start: float, end: float, run_id: str | None = None, now: float | None = None
) -> Finding:
    """Short requests stuck behind long prefills: wide prompt spread and a measurable head-of-line wait.

    A short request (prompt <= median) is behind a long one (prompt >= p90) when the time from its arrival
    to the end of its prefill overlaps a long request's prefill. Cost: the median extra time to first token
    of those short requests over the other short requests (latency), and from step rows the share of decode
    time stalled in steps that carried a long prefill (throughput).
    """
    trap, hours = "mixed_lengths", study_hours(start, now or time.time())
    cols: tuple[str, ...] = ("request_id", "ts", "prompt_tokens", "output_tokens", "queue_s", "prefill_s", "ttft_s")
    cols += tuple(c for c in WAIT_COLUMNS if c not in cols)
    with _bound(db) as conn:
        rows, truncated = request_rows(conn, instance=instance, start=start, end=end, run_id=run_id, columns=cols)
        steps = step_rows(
            conn, instance=instance, start=start, end=end, run_id=run_id, columns=("duration_s", *_STEP_TOKENS)
        )
    if len(rows) < MIN_REQUESTS:
        why = f"{len(rows)} finished requests in the window; the check needs {MIN_REQUESTS}"
        return no_data(trap, instance, why, knob=MIXED_KNOB)
    prompts = sorted(r.prompt_tokens for r in rows)
    # rows is not empty, so every rank is a value
    p10, p50, p90 = (float(v) for q in (0.1, 0.5, 0.9) if (v := nearest_rank(prompts, q)) is not None)
    spread = p90 / max(p10, 1)
    long_ = [r for r in rows if r.prompt_tokens >= p90 and r.prompt_tokens > p50]
    short = [r for r in rows if r.prompt_tokens <= p50]
    merged = _merge([(r.arrival + r.queue_s, r.arrival + r.queue_s + r.prefill_s) for r in long_])
    starts = [a for a, _ in merged]
    waits = [
        (r, waited_s(r) + r.prefill_s, _overlap(merged, starts, r.arrival, r.arrival + r.queue_s + r.prefill_s))
        for r in short
    ]
    behind = [(r, w) for r, w, o in waits if o > 0]
    clear = [w for _, w, o in waits if o == 0]
    wait_behind, wait_clear = median([w for _, w in behind]), median(clear)
    added = [max(0.0, w - wait_clear) for _, w in behind]
    stall = _decode_stall(steps, p90) if long_ else {}
    evidence = {
        "requests": len(rows),
        "prompt_tokens_p10": p10,
        "prompt_tokens_p50": p50,
        "prompt_tokens_p90": p90,
        "spread_p90_p10": spread,
        "short_requests": len(short),
        "long_requests": len(long_),
        "short_behind_long": len(behind),
        "short_wait_behind_p50_s": wait_behind,
        "short_wait_clear_p50_s": wait_clear,
        "added_wait_total_s": sum(added),
        "rows_truncated": truncated,
        **stall,
    }
    present = (
        spread >= LENGTH_SPREAD
        and len(behind) >= MIN_BLOCKED
        and wait_behind >= HOL_RATIO * wait_clear
        and wait_behind - wait_clear >= HOL_MIN_S
    )
    worst = sorted(behind, key=lambda rw: -rw[1])[:EXAMPLES]
    cost_value = wait_behind - wait_clear if behind else 0.0
    stall_text = (
        f"; decoding sequences also stalled {stall['decode_stall_share']:.0%} of their step time in steps "
        f"carrying a long prefill (step duration over the median pure-decode step, {stall['decode_stall_s']:.2f} s "
        "in all)"
        if stall
        else ""
    )
    if present:
        summary = (
            f"Prompts range {p10}-{p90} tokens (p10-p90, {spread:.0f}x); {len(behind)} of {len(short)} short requests "
            f"waited behind a long prefill, a median {wait_behind * 1e3:.0f} ms to prefill done vs "
            f"{wait_clear * 1e3:.0f} ms for the others."
        )
    elif near(spread, LENGTH_SPREAD):
        against = versus(spread, LENGTH_SPREAD, f"{LENGTH_SPREAD:g}", "mixing threshold")
        summary = (
            f"Prompt tokens p90/p10 {spread:.1f} ({p10}-{p90} tokens), {against}: "
            f"sizes vary, not quite enough to count as mixed; {len(behind)} short request(s) waited behind a long "
            f"prefill, a median {wait_behind * 1e3:.0f} ms vs {wait_clear * 1e3:.0f} ms."
        )
    elif spread < LENGTH_SPREAD:
        summary = f"Request sizes are alike: prompt tokens p90/p10 = {spread:.1f} (trap at {LENGTH_SPREAD:g})."
    else:
        ratio = wait_behind / wait_clear if wait_clear > 0 else 0.0
        summary = (
            f"Prompts range {p10}-{p90} tokens ({spread:.0f}x) but short requests barely wait for long prefills: "
            f"{len(behind)} behind one, median {wait_behind * 1e3:.0f} ms vs {wait_clear * 1e3:.0f} ms"
            + (f", {ratio:.1f}x, just under the {HOL_RATIO:g}x threshold." if near(ratio, HOL_RATIO) else ".")
        )
    return finding(
        trap,
        instance,
        present=present,
        summary=summary,
        knob=MIXED_KNOB,
        hours=hours,
        severity="critical" if stall.get("decode_stall_share", 0.0) >= 0.15 else "warning",
        evidence=evidence,
        series={"short requests: queue + prefill seconds": thin([(r.arrival, w) for r, w, _ in waits])},
        requests=request_dicts([r for r, _ in worst], {"wait_s": [w for _, w in worst]}),
        cost=(
            "Latency: short requests behind a long prefill reached their first token a median "
            f"{cost_value * 1e3:.0f} ms later than other short requests ({sum(added):.2f} s over {len(behind)} "
            f"requests; queue + prefill time compared){stall_text}."
        ),
        cost_value=cost_value,
        cost_unit="s TTFT per blocked short request",
    )


_STEP_TOKENS = ("prefill_tokens", "decode_tokens")


def bursts(
    db: Db, *, instance: str, start: float, end: float, run_id: str | None = None, now: float | None = None
) -> Finding:
    """1-s windows with >= 4x the median arrival rate whose arrivals queued a median >= 50 ms.

    The median is over the seconds with traffic (empty seconds between arrivals count; an idle gap of
    IDLE_GAP_S or more does not), or the mean where that median is 0 (sparse traffic). Queue time is what
    users waited (`waited_s`). Cost: queue time of the burst arrivals above the median queue time of the
    other arrivals (latency), and the requests refused during bursts.
    """
    trap, hours = "bursts", study_hours(start, now or time.time())
    cols: tuple[str, ...] = ("request_id", "ts", "status", "prompt_tokens", "queue_s", "ttft_s", "e2e_s")
    cols += tuple(c for c in WAIT_COLUMNS if c not in cols)
    with _bound(db) as conn:
        rows, truncated = request_rows(
            conn, instance=instance, start=start, end=end, run_id=run_id, columns=cols, statuses=None
        )
    if len(rows) < MIN_REQUESTS:
        why = f"{len(rows)} requests in the window; the check needs {MIN_REQUESTS}"
        return no_data(trap, instance, why, knob=BURST_KNOB)
    counts = Counter(math.floor(r.arrival) for r in rows)
    first, last = min(counts), max(counts)
    traffic = seconds_of(arrival_spans(rows))  # idle gaps left out: they are not a baseline
    per_second = [counts.get(s, 0) for s in traffic]
    baseline = float(median(per_second)) or len(rows) / len(per_second)
    basis = "median" if median(per_second) else "mean"  # sparse traffic: most seconds are empty
    burst_s = {s for s, n in counts.items() if n >= BURST_RATIO * baseline and n >= BURST_MIN_ARRIVALS}
    in_burst = [r for r in rows if math.floor(r.arrival) in burst_s]
    finished_burst = [r for r in in_burst if r.status == "finished"]
    calm = [waited_s(r) for r in rows if math.floor(r.arrival) not in burst_s and r.status == "finished"]
    queue_burst, queue_calm = median([waited_s(r) for r in finished_burst]), median(calm)
    refused = sum(r.status == "rejected" for r in in_burst)
    added = [max(0.0, waited_s(r) - queue_calm) for r in finished_burst]
    present = bool(burst_s) and queue_burst >= BURST_QUEUE_S
    peak = max(per_second)
    evidence = {
        "requests": len(rows),
        "baseline_arrivals_per_s": baseline,
        "baseline": basis,
        "traffic_seconds": len(traffic),
        "idle_seconds": last - first + 1 - len(traffic),
        "peak_arrivals_per_s": peak,
        "peak_ratio": peak / baseline,
        "burst_seconds": len(burst_s),
        "burst_arrivals": len(in_burst),
        "burst_queue_p50_s": queue_burst,
        "other_queue_p50_s": queue_calm,
        "refused_in_bursts": refused,
        "rows_truncated": truncated,
    }
    of_traffic = f"the {basis} {baseline:.3g}/s of the {len(traffic)} s with traffic"
    if present:
        summary = (
            f"{len(burst_s)} burst second(s) at up to {peak} arrivals/s ({peak / baseline:.1f}x {of_traffic}); "
            f"their {len(in_burst)} arrivals queued a median {queue_burst * 1e3:.0f} ms "
            f"(others {queue_calm * 1e3:.0f} ms)."
        )
    elif burst_s:
        against = versus(queue_burst, BURST_QUEUE_S, f"{BURST_QUEUE_S * 1e3:g} ms", "burst queue threshold")
        summary = (
            f"{len(burst_s)} burst second(s) at up to {peak} arrivals/s, absorbed: their arrivals queued a median "
            f"{queue_burst * 1e3:.0f} ms, {against}."
        )
    else:
        ratio = peak / baseline
        summary = f"No burst: the busiest second had {peak} arrival(s), {ratio:.1f}x {of_traffic}" + (
            f", {versus(ratio, BURST_RATIO, f'{BURST_RATIO:g}x', 'burst threshold')}."
            if near(ratio, BURST_RATIO)
            else "."
        )
    worst = sorted(in_burst, key=lambda r: -waited_s(r))[:EXAMPLES]
    mean_added = sum(added) / len(added) if added else 0.0
    return finding(
        trap,
        instance,
        present=present,
        summary=summary,
        knob=BURST_KNOB,
        hours=hours,
        severity="critical" if refused or queue_burst >= 10 * BURST_QUEUE_S else "warning",
        evidence=evidence,
        series={"arrivals per second": thin([(float(t), float(counts.get(t, 0))) for t in range(first, last + 1)])},
        requests=request_dicts(worst),
        cost=(
            f"Latency: burst arrivals queued {mean_added * 1e3:.0f} ms more on average than the median queue time "
            f"of other arrivals ({sum(added):.2f} s over {len(finished_burst)} finished requests)"
            + (f"; {refused} request(s) refused during bursts." if refused else ".")
        ),
        cost_value=mean_added,
        cost_unit="s queue per burst arrival",
    )


def cold_start(
    db: Db, *, instance: str, start: float, end: float, run_id: str | None = None, now: float | None = None
) -> Finding:
    """Runs that started in the window: their first 100 requests (after warm-up) vs the rest of the run.

    A run started in the window when its first request row (of all time) is in it; a run that started
    before cannot show its cold start here. Latency is TTFT, or e2e where a run's requests lack TTFT. Cost:
    latency of the first requests above the rest's median, per cold request.
    """
    trap = "cold_start"
    r = RequestRow.__table__.c
    runs_in_window = select(r.run_id).where(*_request_filter(start, end, [instance], run_id, None, False)).distinct()
    firsts = select(r.run_id, func.min(r.ts)).where(  # ts < end: the same minimum, no later day read
        r.instance == instance, r.warmup.is_(False), r.run_id.in_(runs_in_window), r.ts < end
    )
    cols = ("request_id", "run_id", "ts", "prompt_tokens", "output_tokens", "queue_s", "ttft_s", "e2e_s")
    per_run: dict[str, list] = {}
    too_many: list[str] = []
    with _bound(db) as conn:
        started = [run for run, first_ts in conn.execute(firsts.group_by(r.run_id)) if first_ts >= start]
        for run in sorted(started):
            rows, truncated = request_rows(conn, instance=instance, start=start, end=end, run_id=run, columns=cols)
            if truncated:  # the newest rows were kept: the run's first requests are lost
                too_many.append(run)
            else:
                per_run[run] = rows
    if not started:
        why = "no run of this instance started in the window (the first requests of a run must be in it)"
        return no_data(trap, instance, why, knob=COLD_KNOB)
    checked = {}
    for run, rows in per_run.items():
        if len(rows) < COLD_N + COLD_MIN_REST:
            continue
        metric = "ttft_s" if all(row.ttft_s is not None for row in rows) else "e2e_s"
        cold, warm = rows[:COLD_N], rows[COLD_N:]
        cold_p50, warm_p50 = median([getattr(x, metric) for x in cold]), median([getattr(x, metric) for x in warm])
        excess = [max(0.0, getattr(x, metric) - warm_p50) for x in cold]
        ratio = cold_p50 / warm_p50 if warm_p50 > 0 else math.inf if cold_p50 > 0 else 1.0
        checked[run] = {
            "metric": metric,
            "cold_p50_s": cold_p50,
            "rest_p50_s": warm_p50,
            "ratio": ratio,
            "requests": len(rows),
            "excess_s": sum(excess),
            "rows": rows,
        }
    if not checked:
        sizes = ", ".join(
            [f"{run}: {len(rows)}" for run, rows in per_run.items()] + [f"{run}: over {MAX_ROWS:,}" for run in too_many]
        )
        why = f"runs that started in the window have too few finished requests ({sizes}; need {COLD_N + COLD_MIN_REST})"
        if too_many:
            why += " or more than can be read (narrow the window to the run's start)"
        return no_data(trap, instance, why, knob=COLD_KNOB)
    run, worst = max(checked.items(), key=lambda kv: kv[1]["ratio"])
    present = worst["ratio"] >= COLD_RATIO
    metric, rows = worst["metric"], worst["rows"]
    label = "TTFT" if metric == "ttft_s" else "e2e latency"
    summary = (
        f"Run {run}: the first {COLD_N} requests had a median {label} of {worst['cold_p50_s'] * 1e3:.0f} ms, "
        f"{worst['ratio']:.1f}x the {worst['rest_p50_s'] * 1e3:.0f} ms of the {len(rows) - COLD_N} after them"
        + (
            f", {versus(worst['ratio'], COLD_RATIO, f'{COLD_RATIO:g}x', 'cold-start threshold')}."
            if not present
            else "."
        )
    )
    slowest = sorted(rows[:COLD_N], key=lambda x: -getattr(x, metric))[:EXAMPLES]
    return finding(
        trap,
        instance,
        present=present,
        summary=summary,
        knob=COLD_KNOB,
        hours=study_hours(start, now or time.time()),
        severity="critical" if worst["ratio"] >= 2 * COLD_RATIO else "warning",
        evidence={
            "runs_checked": len(checked),
            "run": run,
            "metric": metric,
            "first_n": COLD_N,
            "first_p50_s": worst["cold_p50_s"],
            "rest_p50_s": worst["rest_p50_s"],
            "ratio": worst["ratio"],
            "runs": {k: {n: v for n, v in c.items() if n != "rows"} for k, c in checked.items()},
        },
        series={f"{label} by arrival (run {run})": thin([(x.arrival, getattr(x, metric)) for x in rows])},
        requests=request_dicts(slowest),
        cost=(
            f"Latency: the first {COLD_N} requests of run {run} spent {worst['excess_s']:.2f} s above the rest's "
            f"median {label} in all, {worst['excess_s'] / COLD_N * 1e3:.0f} ms per request on average."
        ),
        cost_value=worst["excess_s"] / COLD_N,
        cost_unit=f"s {label} per cold request",
    )
