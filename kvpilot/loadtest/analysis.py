"""From a run's raw results and scrapes to the report: latency summaries, windows, the pass criteria.

Criteria (the seed's three, plus one that no load tester omits). The target's figures are its /metrics read
through the collector's mapping (`scrape.py`), so they are the same for kvpilot's engine and for vLLM:
- `no_oom`: the target's `oom_total` (kvpilot_oom_total) did not increase during the run. A target with no OOM
  counter but a preemption counter (vLLM: `vllm:num_preemptions_total`) is judged on preemptions: vLLM
  preempts (and later recomputes) a running request when its KV cache is exhausted, and has no other
  KV-exhaustion signal; the criterion's `basis` and detail say so.
- `p99_stable`: |P99(last window) - P99(first window)| / P99(first window) <= 0.20, on the answered
  requests' latency metric, windows by arrival time. The default metric is TPOT (time per output token
  after the first): with the seed's 30/60/10 length mix a window's end-to-end P99 is mostly decided by
  which long request happened to land in it, whereas TPOT moves with the load and the engine's health.
  `--p99-metric e2e|ttft` selects the others.
- `util_stable`: the coefficient of variation (population std / mean) of per-window utilization is < 0.15;
  a window's utilization is the mean of the target's `utilization` gauge (kvpilot_utilization) over the
  scrapes in it that saw the engine step (an idle engine's gauge only repeats its last step). vLLM exposes
  no utilization gauge: its activity signal is the number of requests running (`vllm:num_requests_running`,
  summed over its label sets), over the scrapes that saw its iteration count move; `util_signal` says which.
- `no_errors`: every request was answered or cleanly refused with 429 (no other status, no broken stream,
  no timeout).
- `client_on_time`: the client's p99 lateness (when it began sending against the plan) is <= 50 ms;
  otherwise the target saw another load than planned and the run's figures do not count (`fidelity.py`).
A criterion whose input the target does not expose is reported `passed: false` with the reason.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from kvpilot.loadtest import fidelity
from kvpilot.loadtest.client import RequestResult
from kvpilot.loadtest.runner import RunResult
from kvpilot.loadtest.scrape import MetricsSample, external_names
from plumbing.openloop import lateness
from plumbing.percentile import nearest_rank

P99_DRIFT_LIMIT = 0.20
UTIL_FLUCTUATION_LIMIT = 0.15
UTIL_METHOD = "cv"
UTIL_METHOD_TEXT = (
    "coefficient of variation (population std / mean) of the per-window mean of the target's "
    "{signal}, over scrapes that saw the engine step"
)
# activity signals in order of preference: canonical key -> what the report calls it
UTIL_SIGNALS = {
    "utilization": "utilization gauge",
    "running": "requests running (no utilization gauge exposed; summed over label sets)",
}
LATENCY_METRICS = ("e2e", "ttft", "tpot")
MIN_WINDOW_REQUESTS = 5


def metric_value(res: RequestResult, metric: str) -> float | None:
    if metric == "ttft":
        return res.ttft_s
    if metric == "tpot":
        return res.tpot_s
    return res.e2e_s


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(vals),
        "mean": _r(statistics.fmean(vals)),
        "p50": _r(nearest_rank(vals, 0.5)),
        "p90": _r(nearest_rank(vals, 0.9)),
        "p99": _r(nearest_rank(vals, 0.99)),
        "max": _r(max(vals)),
    }


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def window_bounds(span_s: float, n: int) -> list[tuple[float, float]]:
    width = span_s / n
    return [(i * width, (i + 1) * width) for i in range(n)]


def _in(t: float, bounds: tuple[float, float], last: bool) -> bool:
    return bounds[0] <= t < bounds[1] or (last and t >= bounds[1])


def util_signal(samples: Sequence[MetricsSample]) -> str | None:
    """The first activity signal of UTIL_SIGNALS that the target exposes."""
    return next((key for key in UTIL_SIGNALS if any(key in s.values for s in samples)), None)


def util_windows(
    samples: Sequence[MetricsSample], bounds: list[tuple[float, float]], signal: str = "utilization"
) -> list[float | None]:
    """Mean `signal` per window over the scrapes whose step counter moved since the previous scrape."""
    active: list[tuple[float, float]] = []
    prev_steps = None
    for s in samples:
        steps, util = s.values.get("steps_total"), s.values.get(signal)
        if steps is not None and util is not None and prev_steps is not None and steps > prev_steps:
            active.append((s.t, util))
        if steps is not None:
            prev_steps = steps
    out: list[float | None] = []
    for i, b in enumerate(bounds):
        vals = [u for t, u in active if _in(t, b, i == len(bounds) - 1)]
        out.append(statistics.fmean(vals) if vals else None)
    return out


def fluctuation(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    if mean <= 0:
        return None
    return statistics.pstdev(values) / mean


def _util_detail(fluct: float | None, measured: Sequence[float], signal: str | None, signal_text: str | None) -> str:
    if signal is None:
        return "neither kvpilot_utilization nor a running-requests gauge exposed"
    if fluct is not None:
        return f"{len(measured)} windows with samples of the {signal_text}"
    if len(measured) >= 2:
        # the engine stepped in every window, yet each scrape read 0: requests too short to be caught running
        return f"the {signal_text} read 0 in every scrape that saw the engine step, in all {len(measured)} windows"
    return f"fewer than 2 windows with engine steps and samples of the {signal_text}"


def counter_increase(samples: Sequence[MetricsSample], key: str) -> float | None:
    """Increase of a counter across the run, tolerating a reset (a restarted target)."""
    series = [s.values[key] for s in samples if key in s.values]
    if len(series) < 2:
        return None
    total = 0.0
    for prev, cur in itertools.pairwise(series):
        total += cur - prev if cur >= prev else cur
    return total


def _criterion(passed: bool, value: object, threshold: object, detail: str, basis: str | None = None) -> dict:
    crit = {"passed": passed, "value": value, "threshold": threshold, "detail": detail}
    if basis is not None:
        crit["basis"] = basis
    return crit


def _names(samples: Sequence[MetricsSample], canonical: str) -> str:
    sources = frozenset().union(*(s.sources for s in samples)) if samples else frozenset()
    return ", ".join(external_names(canonical, sources)) or canonical


def oom_criterion(samples: Sequence[MetricsSample]) -> dict:
    oom = counter_increase(samples, "oom_total")
    if oom is not None:
        return _criterion(oom == 0, int(oom), 0, f"increase of {_names(samples, 'oom_total')}", "oom_total")
    preempted = counter_increase(samples, "preemptions_total")
    if preempted is not None:
        return _criterion(
            preempted == 0,
            int(preempted),
            0,
            f"no OOM counter exposed; judged on the increase of {_names(samples, 'preemptions_total')}: the engine "
            "preempts (and later recomputes) a running request when its KV cache is exhausted, its only "
            "KV-exhaustion signal, so every preemption counts as one here",
            "preemptions_total",
        )
    return _criterion(False, None, 0, "kvpilot_oom_total not exposed (nor a preemption counter)")


def analyze(run: RunResult, *, span_s: float, windows: int = 5, metric: str = "tpot") -> dict:
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown latency metric {metric!r}; one of {LATENCY_METRICS}")
    results = run.results
    ok = [r for r in results if r.outcome == "ok"]
    refused = [r for r in results if r.outcome == "refused"]
    timed_out = [r for r in results if r.outcome == "timeout"]
    failed = [r for r in results if r.outcome == "error"]
    bounds = window_bounds(span_s, windows)
    win_rows = []
    for i, b in enumerate(bounds):
        in_win = [r for r in results if _in(r.scheduled_s, b, i == len(bounds) - 1)]
        vals = [v for r in in_win if r.outcome == "ok" and (v := metric_value(r, metric)) is not None]
        win_rows.append(
            {
                "start_s": round(b[0], 3),
                "end_s": round(b[1], 3),
                "sent": len(in_win),
                "answered": sum(r.outcome == "ok" for r in in_win),
                "refused": sum(r.outcome == "refused" for r in in_win),
                "p99_s": _r(nearest_rank(vals, 0.99)),
                "n_latency": len(vals),
            }
        )
    signal = util_signal(run.samples)
    utils = util_windows(run.samples, bounds, signal or "utilization")
    for row, u in zip(win_rows, utils, strict=True):
        row["utilization"] = _r(u, 4)

    first, last = win_rows[0], win_rows[-1]
    drift = None
    if (
        first["p99_s"]
        and last["p99_s"] is not None
        and min(first["n_latency"], last["n_latency"]) >= MIN_WINDOW_REQUESTS
    ):
        drift = (last["p99_s"] - first["p99_s"]) / first["p99_s"]
    p99_crit = _criterion(
        drift is not None and abs(drift) <= P99_DRIFT_LIMIT,
        _r(drift, 4),
        P99_DRIFT_LIMIT,
        f"{metric} P99 first window {first['p99_s']}s, last {last['p99_s']}s"
        if drift is not None
        else f"needs >= {MIN_WINDOW_REQUESTS} answered requests in the first and last window "
        f"(got {first['n_latency']} and {last['n_latency']})",
    )
    measured = [u for u in utils if u is not None]
    fluct = fluctuation(measured)
    signal_text = f"{UTIL_SIGNALS[signal]} ({_names(run.samples, signal)})" if signal else None
    util_crit = _criterion(
        fluct is not None and fluct < UTIL_FLUCTUATION_LIMIT,
        _r(fluct, 4),
        UTIL_FLUCTUATION_LIMIT,
        _util_detail(fluct, measured, signal, signal_text),
        signal,
    )
    oom_crit = oom_criterion(run.samples)
    bad = len(failed) + len(timed_out)
    err_crit = _criterion(
        bad == 0,
        bad,
        0,
        "requests neither answered nor refused with 429" + (f"; first: {(failed + timed_out)[0].error}" if bad else ""),
    )
    late = fidelity.lateness(lateness([r.lateness_s for r in results]))
    on_time = _criterion(late["on_time"], late["p99_s"], fidelity.LATENESS_LIMIT_S, fidelity.verdict(late))
    criteria = {
        "no_oom": oom_crit,
        "p99_stable": p99_crit,
        "util_stable": util_crit,
        "no_errors": err_crit,
        "client_on_time": on_time,
    }

    wall = max(run.wall_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    report = {
        "passed": all(c["passed"] for c in criteria.values()),
        "figures_count": late["on_time"],
        "criteria": criteria,
        "client_lateness": late,
        "tokens": fidelity.tokens(results, run.prompt_form),
        "oom_events": oom_crit["value"],
        "p99_metric": metric,
        "p99_s": _r(nearest_rank([v for r in ok if (v := metric_value(r, metric)) is not None], 0.99)),
        "p99_first_window_s": first["p99_s"],
        "p99_last_window_s": last["p99_s"],
        "p99_drift": _r(drift, 4),
        "util_fluctuation": _r(fluct, 4),
        "util_fluctuation_method": UTIL_METHOD,
        "util_fluctuation_method_detail": UTIL_METHOD_TEXT.format(signal=signal_text or "utilization gauge"),
        "util_signal": signal,
        "utilization_mean": _r(statistics.fmean(measured), 4) if measured else None,
        "requests_sent": len(results),
        "requests_answered": len(ok),
        "requests_refused": len(refused),
        "requests_failed": len(failed),
        "requests_timed_out": len(timed_out),
        "preemptions": _int(counter_increase(run.samples, "preemptions_total")),
        "engine_rejected": _int(counter_increase(run.samples, "rejected_total")),
        "latency_s": {
            "e2e": summarize([r.e2e_s for r in ok]),
            "ttft": summarize([r.ttft_s for r in ok]),
            "tpot": summarize([r.tpot_s for r in ok]),
        },
        "throughput": {
            "requests_per_s": _r(len(ok) / wall, 3),
            "output_tokens_per_s": _r(out_tokens / wall, 1),
            "offered_rate_per_s": _r(len(results) / max(run.send_span_s, 1e-9), 3),
        },
        "windows": win_rows,
        "wall_s": _r(run.wall_s, 3),
        "late_starts": run.late_starts,
        "scrapes": len(run.samples),
        "scrape_failures": run.scrape_failures,
        "errors_sample": sorted({r.error for r in failed + timed_out if r.error})[:5],
    }
    if run.published is not None:
        report["published"] = run.published
    if run.actions:
        report["actions"] = run.actions
    return report


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
