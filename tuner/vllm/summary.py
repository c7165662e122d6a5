"""A vLLM tuning's summary, as `kvpilot tune vllm study` and `nightly` print it and write it to --json: rendered
from the tuning and its outcome (`tuner.vllm.tune`), not by the CLI."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tuner.metrics import SLO, TrialMetrics
from tuner.report import num
from tuner.vllm.tune import Outcome, VllmTuning


def changes_text(changed: dict[str, Any]) -> str:
    """Changed vLLM arguments as the command line spells them."""
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in changed.items()) or "none"


def none_confirmed(sim_feasible: int) -> str:
    """Why the screen confirmed nothing live."""
    if sim_feasible == 0:
        return (
            "no simulated config met the constraints (p99 TTFT, p99 end-to-end, refusals); loosen "
            "--p99-ttft-slo / --p99-e2e-slo or lower the load"
        )
    return "every feasible simulated config pruned back to the running one (no change moved its goodput by 1%)"


def broken(metrics: dict[str, Any] | None, slo: SLO) -> dict[str, float]:
    """The constraints a measurement broke and by how much (`TrialMetrics.constraints`: > 0 is broken)."""
    if not metrics:
        return {}
    return {k: v for k, v in TrialMetrics(**metrics).constraints(slo).items() if v > 0}


def study_summary(
    tuning: VllmTuning, outcome: Outcome, *, name: str, workload: dict, checked: str, t0: float
) -> dict[str, Any]:
    """What `kvpilot tune vllm study` and `nightly` print and write to --json: the decision, the running config
    (live and its capacity), the screen, the live comparison, the client's lateness, restart costs, phase times."""
    screened, base, cap = tuning.screened, tuning.baseline_live, tuning.running_capacity
    p = outcome.proposal
    return {
        "study": name,
        "decision": outcome.decision,
        "proposal": {"id": p.row.id, "config": str(p.config_path), "report": str(p.report_path)} if p else None,
        "report": str(outcome.report_path),
        "changed": outcome.changed,
        "workload": workload,
        "slo": dataclasses.asdict(tuning.slo),
        "budget": dataclasses.asdict(tuning.budget),
        "space": checked,
        "baseline": {
            "goodput_tps": base.metrics["goodput_tps"] if base.metrics else None,
            "feasible": base.feasible,
            "constraints_broken": broken(base.metrics, tuning.slo),
            "sim_goodput_tps": base.sim_goodput,
            "metrics": base.metrics,
        },
        "sim_trials": screened.sim_trials,
        "sim_feasible": sum(t.feasible for t in screened.sim.completed),
        "live_trials": screened.live_trials,
        "screened": tuning.screened_rows(),
        "capacity": None if cap is None else cap.summary(),
        "capacities": [{k: v for k, v in r.items() if k != "config"} for r in tuning.confirmed],
        "heldout": tuning.heldout_summary(),
        "notes": outcome.notes,
        "restart_cost": outcome.restart,
        "client": tuning.backend.client_lateness(),  # how late the replay client sent; late replays repeated
        "scrape_targets": {  # each started trial's /metrics: registered ('created'/'exists'/None), and left behind
            "registered": [x.target for x in tuning.backend.launches],
            "left": tuning.backend.stale_targets,
        },
        "profile": outcome.profile,
        "phases_s": tuning.phases,
        "pipeline_s": outcome.verdict.phases_s,  # baseline, screen, confirm, ...
        "wall_s": round(time.time() - t0, 1),
    }


def study_lines(s: dict[str, Any]) -> list[str]:
    """The summary (`study_summary`) as the CLI prints it."""
    w = s["workload"]
    lines = [f"tune vllm study {s['study']}: {s['decision']}"]
    rate = f", capacity {w['capacity_rps']} req/s" if "capacity_rps" in w else ""
    lines.append(f"  workload: {w.get('kind')}{rate}; space {s['space']}")
    h, cap = s["heldout"], s["capacity"]
    if cap is not None:
        lines.append(
            f"  running config: capacity {cap['capacity_rps']:.2f} req/s (x{cap['multiplier']:.2f} the traffic)"
        )
    lines += [f"  {note}" for note in s["notes"]]
    if h is not None:
        lines.append(
            f"  live comparison: running {h['running_capacity_rps']:.2f} req/s, candidate "
            f"{h['candidate_capacity_rps']:.2f} req/s over {len(h['pairs'])} ABBA pair(s)"
            f"{', each on fresh servers' if h['fresh_servers'] else ''}: {h['verdict']}"
        )
    else:
        b = s["baseline"]
        broken = ", ".join(f"{k} over its limit by {v:.3g}" for k, v in b["constraints_broken"].items())
        verdict = "" if b["feasible"] else f" (infeasible: {broken or 'not measured'})"
        lines.append(f"  running config: {num(b['goodput_tps'], ' goodput tokens/s')} on the tuning seeds{verdict}")
    lines.append(f"  changes: {changes_text(s['changed'])}")
    prof = s["profile"]
    lines.append(
        f"  search: {s['sim_trials']} configs simulated (cost model from {prof.get('steps')} stored steps, "
        f"R² {prof.get('r2')}), {s['live_trials']} measured live"
    )
    if len(s["screened"]) == 1:
        lines.append(f"    nothing confirmed live: {none_confirmed(s['sim_feasible'])}")
    for row in s["screened"][1:]:
        live = f"{num(row['live_goodput'])} live" if row["feasible"] else f"infeasible: {row['infeasible'] or 'SLO'}"
        lines.append(f"    {changes_text(row['changed'])}: {num(row['sim_goodput'])} simulated, {live}")
    c = s["client"]
    if c["late_p99_s"] is not None:
        lines.append(
            f"  replay client: p99 send lateness {c['late_p99_s'] * 1e3:.0f} ms at worst; {c['late_replays']} "
            f"replay(s) repeated for lateness, {c['not_measured']} not measured"
        )
    r = s["restart_cost"]
    if r.get("ready_s"):
        rd, st = r["ready_s"], r.get("stop_s") or {}
        lines.append(
            f"  restart cost per trial: {rd['mean']} s to serve ({rd['min']}–{rd['max']}) over {r['launches']} "
            f"start(s), {st.get('mean', '—')} s to stop; {r['refused_or_crashed']} refused or crashed"
        )
    p = s["proposal"]
    if p is not None:
        lines.append(
            f"  proposal {p['id']} (pending): {p['config']} — restart vLLM with `vllm serve --config {p['config']}`"
        )
        lines.append(f"  report: {p['report']}")
    else:
        lines.append(f"  report: {s['report']}")
    lines.append(f"  wall time {s['wall_s']:.0f} s")
    return lines
