"""The human side of a study: a markdown report and a Pareto plot (PNG, matplotlib optional)."""

from __future__ import annotations

import io
import logging
import math
import statistics
from typing import Any

from tuner.study import StudyResult, TrialRecord

log = logging.getLogger("kvpilot.tuner.report")


def num(value: Any, unit: str = "", digits: int = 3) -> str:
    """A figure as reports and summaries print it: "—" for None, floats to `digits` significant digits (one
    decimal with thousands separators from 100 on), then `unit`."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return (f"{value:,.1f}" if abs(value) >= 100 else f"{value:.{digits}g}") + unit
    return f"{value}{unit}"


def _n(v: float) -> str:
    return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"


def spread(values: list[float]) -> str:
    """mean ± sd (min, max, n), with the digits small figures (seconds) need."""
    if not values:
        return "—"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{_n(mean)} ± {_n(sd)} (min {_n(min(values))}, max {_n(max(values))}, n={len(values)})"


def comparison_lines(record: dict[str, Any], heading: str, *, setting: str) -> list[str]:
    """A capacity comparison (`tuner.compare.Comparison.as_dict`) as a report section: each ABBA pair's
    capacities and ratio, both sides' spread, and the verdict with its interval. `setting`: how the two configs
    ran (each on its own server, a simulator...)."""
    lines = [
        "",
        heading,
        "",
        f"{setting} Each pair is four capacity measurements in the order running, candidate, candidate, running on "
        "one held-out seed; a capacity is the largest multiple of the seed's arrival rate within the SLOs.",
        "",
        "| seed | running req/s | candidate req/s | pair ratio | replays |",
        "|---|---|---|---|---|",
    ]
    for p in record["pairs"]:
        run, cand = p["running"], p["candidate"]
        lines.append(
            f"| {p['seed']} | {run[0]:.2f}, {run[1]:.2f} | {cand[0]:.2f}, {cand[1]:.2f} | "
            f"{math.exp(p['log_ratio']):.3f} | {p['replays']} |"
        )
    runs = [x for p in record["pairs"] for x in p["running"]]
    cands = [x for p in record["pairs"] for x in p["candidate"]]
    lines += [
        "",
        f"Running {spread(runs)} req/s; candidate {spread(cands)} req/s.",
        "",
        f"**{record['verdict']}**: {record['sentence']}.",
    ]
    return lines


def changes(baseline: dict[str, Any], best: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, baseline.get(k), v) for k, v in best.items() if baseline.get(k) != v]


def search_summary(result: StudyResult) -> dict[str, Any]:
    best = result.best
    rnd = result.random.best if result.random is not None else None
    out = {
        "study": result.name,
        "sampler": result.sampler,
        "trials": result.measured,
        "duplicates": len(result.trials) - result.measured,
        "failed": result.failed,
        "feasible": sum(t.feasible for t in result.completed),
        "baseline_goodput_tps": result.baseline.goodput if result.baseline else None,
        "best_goodput_tps": best.goodput if best else None,
        "best_trial": best.number if best else None,
        "random_best_goodput_tps": rnd.goodput if rnd else None,
        "random_trials": result.random.measured if result.random else 0,
    }
    if best and rnd and rnd.goodput > 0:
        out["best_over_random"] = best.goodput / rnd.goodput - 1.0
    return out


def study_summary(result: StudyResult, *, workload: Any, backend: str, multi_objective: bool = False) -> dict[str, Any]:
    """What `kvpilot tune study` prints and writes as JSON: the search's figures, the best trial's changes and
    metrics beside the running config's, and the Pareto front of a multi-objective study."""
    best, baseline = result.best, result.baseline
    base_params = baseline.params if baseline else {}
    out = {
        **search_summary(result),
        "workload": workload,
        "backend": backend,
        "best_params": best.params if best else None,
        "best_changes": {k: (a, b) for k, a, b in changes(base_params, best.params)} if best else None,
        "best_metrics": best.metrics if best else None,
        "baseline_metrics": baseline.metrics if baseline else None,
        "notes": result.notes,
    }
    if multi_objective:
        out["pareto"] = [
            {"trial": t.number, "throughput_tps": t.values[0], "e2e_p99_s": t.values[1], "params": t.params}
            for t in result.pareto
        ]
    return out


def study_lines(summary: dict[str, Any]) -> list[str]:
    """`study_summary` as the lines the CLI prints."""
    s = summary
    head = (
        f"study {s['study']} ({s['sampler']}, backend {s['backend']}): {s['trials']} trials measured, "
        f"{s['feasible']} feasible, {s['failed']} failed, {s['duplicates']} repeats told a stored result"
    )
    base, best = s.get("baseline_goodput_tps"), s.get("best_goodput_tps")
    lines = [head, f"  running config: {num(base, ' goodput tokens/s')}"]
    if best is None:
        lines.append("  best: no trial met the constraints")
    else:
        gain = f" ({best / base - 1:+.1%})" if base else ""
        lines.append(f"  best: {num(best, ' goodput tokens/s')}{gain}, trial {s['best_trial']}")
        changed = s.get("best_changes") or {}
        lines.append("  changes: " + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "none"))
    if s.get("random_trials"):
        vs = f" ({s['best_over_random']:+.1%} for {s['sampler']})" if "best_over_random" in s else ""
        lines.append(f"  random search, same budget: {num(s.get('random_best_goodput_tps'), ' goodput tokens/s')}{vs}")
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    if "pareto" in s:
        lines.append(f"  Pareto front: {len(s['pareto'])} configs (throughput vs p99 end-to-end)")
    return lines


def render_markdown(
    result: StudyResult,
    *,
    title: str,
    workload: dict[str, Any],
    backend: str,
    confirmation: dict[str, Any] | None,
    decision: str,
    plot_name: str | None,
    pruning: dict[str, Any] | None = None,
    running_capacity: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> str:
    """`pruning`: which changes of the best trial were kept, measured one by one (tuner.prune.drop_noise_knobs);
    `running_capacity`: the running config's capacity (`Capacity.summary`); `notes`: the headroom line and such."""
    s = search_summary(result)
    base, best = result.baseline, result.best
    lines = [f"# {title}", "", f"**Decision:** {decision}", ""]
    if running_capacity is not None:
        c = running_capacity
        lines += [
            f"**The running config** serves {c['capacity_rps']:.3g} req/s within the SLOs (x{c['multiplier']:.3g} "
            f"the traffic's {c['rate_rps']:.3g} req/s; {c['replays']} replays).",
            "",
        ]
    lines += [f"- {n}" for n in notes or []] + ([""] if notes else [])
    lines += [
        "## Search",
        "",
        f"- backend `{backend}`, study `{result.name}`, sampler {result.sampler}, {s['trials']} trials "
        f"({s['feasible']} feasible, {s['failed']} failed); trial 0 is the current config",
        f"- workload: {', '.join(f'{k}={v}' for k, v in workload.items())}",
        f"- best found: {num(s['best_goodput_tps'])} goodput tokens/s (trial {s['best_trial']}); current config "
        f"{num(s['baseline_goodput_tps'])}",
    ]
    if result.random is not None:
        rnd = s["random_best_goodput_tps"]
        found = f"best {num(rnd)} goodput tokens/s" if rnd is not None else "no feasible trial"
        lines.append(
            f"- random search, same budget ({s['random_trials']} trials): {found}"
            + (f"; {result.sampler} is {s['best_over_random']:+.1%} against it" if "best_over_random" in s else "")
        )
    lines += [f"- {n}" for n in result.notes]
    if base and best and pruning:
        lines += pruning_lines(pruning)
    elif base and best:
        lines += ["", "## What changed", "", "| knob | current | proposed |", "|---|---|---|"]
        diff = changes(base.params, best.params)
        lines += [f"| `{k}` | {num(a)} | {num(b)} |" for k, a, b in diff] or ["| (none) | | |"]
    if confirmation:
        lines += comparison_lines(
            confirmation,
            "## Confirmation: SLO capacity on new workload seeds",
            setting=f"The current and the proposed config on the `{backend}` backend, one after the other.",
        )
    if plot_name:
        lines += ["", "## Trade-off", "", f"![throughput vs p99]({plot_name})"]
    return "\n".join(lines) + "\n"


def pruning_lines(pruning: dict[str, Any]) -> list[str]:
    """The best trial's changes, each with what reverting it cost: kept when it mattered, dropped when not."""
    knobs = pruning["knobs"]
    kept = [k for k in knobs if k["kept"]]
    lines = [
        "",
        "## What changed",
        "",
        f"Each change of the best trial was reverted alone on seeds {pruning['seeds']}; a change stays only when "
        f"reverting it costs goodput on every seed and at least {pruning['min_effect']:.1%} on average, or breaks "
        "an SLO. The others are inside the noise and dropped.",
        "",
        "| knob | current | best trial | proposed | goodput lost when reverted |",
        "|---|---|---|---|---|",
    ]
    for k in knobs:
        proposed = num(k["proposed"]) if k["kept"] else f"{num(k['current'])} (dropped)"
        cost = f"{k['effect']:+.1%}" + (" and misses an SLO" if k["slo"] else "")
        lines.append(f"| `{k['knob']}` | {num(k['current'])} | {num(k['proposed'])} | {proposed} | {cost} |")
    if not knobs:
        lines.append("| (none) | | | | |")
    lines += ["", f"{len(kept)} of {len(knobs)} changes kept."]
    return lines


def pareto_png(result: StudyResult) -> bytes | None:
    """Throughput vs p99 end-to-end latency of every trial, Pareto front highlighted; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; the report has no Pareto plot (pip install 'kvpilot[tune]')")
        return None
    pts = [(t, t.metrics) for t in result.completed if t.metrics and t.metrics.get("e2e_p99_s") is not None]
    if not pts:
        return None
    front = _front([t for t, _ in pts])
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for feasible, color, label in ((True, "tab:blue", "feasible"), (False, "tab:gray", "infeasible")):
        sel = [m for t, m in pts if t.feasible == feasible]
        if sel:
            ax.scatter(
                [m["e2e_p99_s"] for m in sel], [m["throughput_tps"] for m in sel], s=18, c=color, label=label, alpha=0.7
            )
    if front:
        fm = sorted((t.metrics for t in front), key=lambda m: m["e2e_p99_s"])
        ax.plot(
            [m["e2e_p99_s"] for m in fm],
            [m["throughput_tps"] for m in fm],
            "-o",
            c="tab:orange",
            ms=4,
            label="Pareto front",
        )
    for rec, marker, label in ((result.baseline, "s", "current"), (result.best, "*", "proposed")):
        if rec is not None and rec.metrics and rec.metrics.get("e2e_p99_s") is not None:
            ax.scatter(
                [rec.metrics["e2e_p99_s"]],
                [rec.metrics["throughput_tps"]],
                marker=marker,
                s=120,
                c="tab:red",
                label=label,
                zorder=5,
            )
    ax.set_xlabel("p99 end-to-end latency (s)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title(f"{result.name}: {len(pts)} trials")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _front(trials: list[TrialRecord]) -> list[TrialRecord]:
    feas = [t for t in trials if t.feasible]
    out = []
    for t in feas:
        thr, p99 = t.metrics["throughput_tps"], t.metrics["e2e_p99_s"]
        if not any(
            o.metrics["throughput_tps"] >= thr
            and o.metrics["e2e_p99_s"] <= p99
            and (o.metrics["throughput_tps"] > thr or o.metrics["e2e_p99_s"] < p99)
            for o in feas
        ):
            out.append(t)
    return out
