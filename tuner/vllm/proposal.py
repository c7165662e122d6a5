"""A vLLM tuning proposal: vLLM's `--config` YAML, the markdown report (before/after measured on the real engine
with spread), and a `proposals` row (`tuner.proposals`, engine `vllm`), written the way nightly proposals are:
the config to a temporary name first, the row committed, then the files renamed into place.
"""

from __future__ import annotations

import logging
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from integrations.vllm.config import VllmConfig
from tuner.metrics import SLO
from tuner.proposals import ProposalView, create_proposal
from tuner.report import _fmt
from tuner.vllm.screen import ScreenResult

log = logging.getLogger("kvpilot.tuner.vllm.proposal")

ROWS = (
    ("goodput_tps", "goodput tokens/s"),
    ("throughput_tps", "throughput tokens/s"),
    ("ttft_p99_s", "p99 TTFT s"),
    ("tpot_p99_s", "p99 TPOT s"),
    ("e2e_p99_s", "p99 end-to-end s"),
    ("rejection_rate", "refused share"),
)


def _n(v: float) -> str:
    return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"


def spread(values: list[float]) -> str:
    """mean ± sd (min, max, n), with the digits small figures (seconds) need."""
    if not values:
        return "—"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{_n(mean)} ± {_n(sd)} (min {_n(min(values))}, max {_n(max(values))}, n={len(values)})"


def render_report(
    *,
    title: str,
    decision: str,
    workload: dict[str, Any],
    slo: SLO,
    base: VllmConfig,
    screened: ScreenResult,
    heldout: dict[str, Any] | None,
    restart: dict[str, Any] | None = None,
    profile: dict[str, Any] | None = None,
    live_only: dict[str, Any] | None = None,
) -> str:
    best = screened.best
    lines = [f"# {title}", "", f"**Decision:** {decision}", ""]
    lines += ["## Workload and SLOs", "", f"- workload: {', '.join(f'{k}={v}' for k, v in workload.items())}"]
    lines += [f"- SLOs: TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s (goodput: output tokens/s of requests in both)"]
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
            f"{_fmt(live_only['best_goodput'])} goodput tokens/s"
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
        "| config | put back (inside the noise) | sim goodput | live goodput | feasible live |",
        "|---|---|---|---|---|",
    ]
    for m in (screened.baseline, *screened.confirmed):
        changes = ", ".join(f"{k}={b}" for k, _a, b in base.changed(m.config))
        label = "running config" if m is screened.baseline else changes
        live = _fmt(m.metrics["goodput_tps"]) if m.metrics else f"infeasible: {m.infeasible}"
        put_back = ", ".join(m.reverted) or "—"
        lines.append(f"| {label} | {put_back} | {_fmt(m.sim_goodput)} | {live} | {m.feasible} |")
    lines += ["", "## What changed", "", "| argument | running | proposed |", "|---|---|---|"]
    lines += [f"| `--{k.replace('_', '-')}` | {_fmt(a)} | {_fmt(b)} |" for k, a, b in base.changed(best.config)] or [
        "| (none) | | |"
    ]
    if heldout:
        lines += [
            "",
            "## Before and after on held-out seeds (real vLLM)",
            "",
            f"Seeds {heldout['seeds']} x {heldout['repeats']}, both configs on each seed in alternating order; "
            "mean ± sd (min, max, n).",
            "",
            "| metric | before (running) | after (proposed) |",
            "|---|---|---|",
        ]
        for key, label in ROWS:
            before = [r[key] for r in heldout["baseline"] if r.get(key) is not None]
            after = [r[key] for r in heldout["best"] if r.get(key) is not None]
            lines.append(f"| {label} | {spread(before)} | {spread(after)} |")
        lines += [
            "",
            f"Gain {heldout['gain']:+.1%} (paired by seed); one-sided 90% lower bound {heldout['gain_low']:+.1%}; "
            f"proposed config feasible on every run: {heldout['best_feasible_all']}.",
        ]
        for label, other in (heldout.get("others") or {}).items():
            g = other["goodput"]
            lines.append(
                f"On the same runs, `{label}`: {g['mean']:.1f} ± {g['sd']:.1f} goodput tokens/s "
                f"({other['gain']:+.1%} over the running config, lower bound {other['gain_low']:+.1%})."
            )
    lines += ["", "## Apply", "", "vLLM reloads nothing at run time: restart it with the proposal file,", ""]
    lines += ["```bash", "vllm serve --config proposal-ID.yaml  # or: kvpilot vllm serve -- --config proposal-ID.yaml"]
    lines += ["```"]
    return "\n".join(lines) + "\n"


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
