"""A vLLM tuning proposal: vLLM's `--config` YAML, the markdown report (what it buys: SLO capacity, the live ABBA
comparison with its interval, headroom or extra memory), and a `proposals` row (`tuner.proposals`, engine `vllm`),
written the way nightly proposals are: the config to a temporary name first, the row committed, then the files
renamed into place.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from integrations.vllm.config import VllmConfig
from tuner.capacity import MIN_FINISHED
from tuner.compare import Comparison
from tuner.metrics import SLO
from tuner.proposals import ProposalView, create_proposal
from tuner.report import comparison_lines, num
from tuner.vllm.screen import ScreenResult

log = logging.getLogger("kvpilot.tuner.vllm.proposal")


def render_report(
    *,
    title: str,
    decision: str,
    workload: dict[str, Any],
    slo: SLO,
    base: VllmConfig,
    best: VllmConfig,
    screened: ScreenResult,
    capacities: list[dict[str, Any]],
    heldout: Comparison | None,
    aa: Comparison | None = None,
    notes: list[str] | None = None,
    restart: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
    live_only: dict[str, Any] | None = None,
) -> str:
    """The markdown report: the decision in what it buys (capacity at the same SLOs), the search, the live
    comparison with its interval, and the headroom or extra memory (`notes`)."""
    lines = [f"# {title}", "", f"**Decision:** {decision}", ""]
    lines += [f"- {note}" for note in notes or []] + ([""] if notes else [])
    ttft = slo.p99_ttft_limit_s
    lines += ["## Workload and SLOs", "", f"- workload: {', '.join(f'{k}={v}' for k, v in workload.items())}"]
    lines += [
        f"- SLO capacity: the most of this traffic (its arrivals time-compressed) served with p99 TTFT as users see "
        f"it within {ttft:g} s, p99 TPOT within {slo.tpot_s:g} s and at least {MIN_FINISHED:.0%} of requests "
        f"finished; goodput (TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s) at the recorded rate beside it"
    ]
    lines += ["", "## Search", ""]
    lines.append(
        f"- simulator: {screened.sim_trials} configs screened on a cost model fitted from vLLM's own stored steps"
        + (
            f" ({profile['steps']} steps, R² {profile['r2']}, MAPE {profile['mape']}, per-step overhead "
            f"{profile['overhead_ms']} ms)"
            if profile
            else ""
        )
    )
    confirmations = len(screened.confirmed)
    lines.append(f"- live on vLLM: {screened.live_trials} trials (the running config, {confirmations} confirmations)")
    if live_only:
        lines.append(
            f"- live-only Optuna search for comparison: {live_only['trials']} trials, best "
            f"{num(live_only.get('best_capacity_rps'))} req/s capacity"
        )
    if restart and restart.get("ready_s"):
        r = restart["ready_s"]
        lines.append(
            f"- restart cost per trial: {r['mean']} s to serve (min {r['min']}, max {r['max']}) over "
            f"{restart['launches']} starts"
        )
    lines += [
        "",
        "Each candidate keeps only the changes whose revert costs simulated goodput on every seed and at least "
        f"{screened.min_effect:.1%} on average (or misses the SLOs); the others are put back before it runs live.",
        "",
        "| config | put back (inside the noise) | goodput at the recorded rate, live | feasible live |",
        "|---|---|---|---|",
    ]
    for m in (screened.baseline, *screened.confirmed):
        label = _changes(base, m.config) if m is not screened.baseline else "running config"
        live = num(m.metrics["goodput_tps"]) if m.metrics else f"infeasible: {m.infeasible}"
        lines.append(f"| {label} | {', '.join(m.reverted) or '—'} | {live} | {m.feasible} |")
    if capacities:
        lines += ["", "| config | predicted capacity req/s | live capacity req/s | replays |", "|---|---|---|---|"]
        for row in capacities:
            label = _changes(base, row["config"]) or "running config"
            lines.append(
                f"| {label} | {row['predicted_capacity_rps']:.2f} | {row['live_capacity_rps']:.2f} | "
                f"{row['live']['replays']} |"
            )
        by_sim = max(capacities, key=lambda r: r["predicted_capacity_rps"])
        by_live = max(capacities, key=lambda r: r["live_capacity_rps"])
        if by_sim is not by_live:
            lines += [
                "",
                f"The simulator's best ({_changes(base, by_sim['config']) or 'the running config'}) is not the live "
                f"best ({_changes(base, by_live['config']) or 'the running config'}): the live figures decide.",
            ]
    lines += ["", "## What changed", "", "| argument | running | proposed |", "|---|---|---|"]
    lines += [f"| `--{k.replace('_', '-')}` | {num(a)} | {num(b)} |" for k, a, b in base.changed(best)] or [
        "| (none) | | |"
    ]
    if heldout is not None:
        lines += _comparison(heldout, "## Live comparison on held-out seeds (real vLLM)")
    if aa is not None:
        lines += _comparison(aa, "## A/A check: the running config against itself")
    lines += ["", "## Apply", "", "vLLM reloads nothing at run time: restart it with the proposal file,", ""]
    lines += ["```bash", "vllm serve --config proposal-ID.yaml  # or: kvpilot vllm serve -- --config proposal-ID.yaml"]
    lines += ["```"]
    return "\n".join(lines) + "\n"


def _changes(base: VllmConfig, config: VllmConfig) -> str:
    return ", ".join(f"{k}={b}" for k, _a, b in base.changed(config))


def _comparison(c: Comparison, heading: str) -> list[str]:
    return comparison_lines(
        c.as_dict(), heading, setting="Both configs on their own server, both up, the idle one paused."
    )


@dataclass(frozen=True)
class VllmProposal:
    row: ProposalView
    config_path: Path
    report_path: Path


def publish(
    db: Engine,
    out_dir: str | Path,
    *,
    name: str,
    instance: str | None,
    base: VllmConfig,
    best: VllmConfig,
    report_md: str,
    baseline_metrics: dict[str, Any],
    best_metrics: dict[str, Any],
) -> VllmProposal:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_yaml = best.to_config_yaml()
    tmp = out / f".proposal-{uuid.uuid4().hex[:8]}.yaml.tmp"
    tmp.write_text(config_yaml)
    try:
        row = create_proposal(
            db,
            config_yaml=config_yaml,
            report_md=report_md,
            study_name=name,
            instance=instance,
            baseline_metrics={**baseline_metrics, "config": base.engine_args()},
            best_metrics={**best_metrics, "changed": {k: b for k, _a, b in base.changed(best)}},
            engine="vllm",
        )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    config_path, report_path = out / f"proposal-{row.id}.yaml", out / f"report-{row.id}.md"
    tmp.replace(config_path)
    report_tmp = out / f".report-{row.id}.md.tmp"
    report_tmp.write_text(report_md.replace("proposal-ID.yaml", config_path.name))
    report_tmp.replace(report_path)
    log.info("vLLM proposal %d written: %s, %s", row.id, config_path, report_path)
    return VllmProposal(row, config_path, report_path)
