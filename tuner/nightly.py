"""`kvpilot tune nightly`: the stored traffic as it came -> study (+ random baseline) -> confirmation
re-run of the current and the best config on new workload seeds -> a proposal only when the gain holds.

A proposal is three files and a row: `proposal-<id>.yaml` (an EngineConfig: `kvpilot engine serve
--config` applies it), `report-<id>.md`, `pareto-<id>.png`, and a `proposals` row (status pending).
Everything is rendered in memory and written to temporary names first; the row is committed, then the
files are renamed into place, so a failure leaves neither a row without files nor files without a row.
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from tuner import workloads as WL
from tuner.backends import Backend
from tuner.jobs import base_config, make_backend, open_db, workload_factory
from tuner.metrics import SLO
from tuner.profile import load_profile
from tuner.proposals import ProposalView, create_proposal, running_tunables
from tuner.prune import drop_noise_knobs, seed_measurer
from tuner.report import pareto_png, render_markdown, search_summary
from tuner.space import load_space
from tuner.storage import open_storage
from tuner.study import StudyResult, run_study

log = logging.getLogger("kvpilot.tuner.nightly")


@dataclass
class NightlyResult:
    study: StudyResult
    decision: str
    proposal: ProposalView | None
    confirmation: dict[str, Any] | None
    files: dict[str, Path] = field(default_factory=dict)
    report_md: str = ""
    pruning: dict[str, Any] | None = None  # the changes kept and dropped (effect inside the noise)


def confirm(
    backend: Backend, base: EngineConfig, best: EngineConfig, *, slo: SLO, seeds: list[int], name: str, min_gain: float
) -> dict[str, Any]:
    """Re-run current and best on the same new seeds; the gain holds only if the best is feasible and
    ahead on every seed and its mean gain reaches `min_gain`."""
    runs: dict[str, list[dict]] = {"baseline": [], "best": []}
    feasible = []
    for seed in seeds:
        for label, cfg in (("baseline", base), ("best", best)):
            m = backend.evaluate(cfg, run_id=f"{name}-confirm-{label}-s{seed}-{uuid.uuid4().hex[:6]}", seed=seed)
            runs[label].append(m.as_dict())
            if label == "best":
                feasible.append(m.feasible(slo))
    before = [m["goodput_tps"] for m in runs["baseline"]]
    after = [m["goodput_tps"] for m in runs["best"]]
    mean_before = statistics.fmean(before)
    gain = (statistics.fmean(after) / mean_before - 1.0) if mean_before > 0 else (float("inf") if any(after) else 0.0)
    ahead = all(a > b for a, b in zip(after, before, strict=True))
    return {
        "seeds": seeds,
        "baseline": runs["baseline"],
        "best": runs["best"],
        "gain": gain,
        "min_gain": min_gain,
        "best_feasible_all": all(feasible),
        "best_ahead_all": ahead,
        "holds": all(feasible) and ahead and gain >= min_gain,
    }


def run_nightly(
    *,
    db_url: str,
    out_dir: str | Path,
    trials: int = 40,
    backend: str = "sim",
    profile: str = "cpu-2core",
    workload: str = "stored",
    options: WL.WorkloadOptions | None = None,
    config_path: str | Path | None = None,
    space_path: str | Path | None = None,
    slo: SLO | None = None,
    seed: int = 0,
    confirm_seeds: int = 3,
    seeds_per_trial: int = 1,
    min_gain: float = 0.02,
    min_effect: float = 0.01,
    instance: str | None = None,
    storage_url: str | None = None,
    live: dict[str, Any] | None = None,
    progress: bool = True,
    engine_url: str | None = None,
    admin_token: str | None = None,
) -> NightlyResult:
    """The whole nightly job; returns the proposal (None when the gain did not hold).

    The proposal changes only the knobs that measurably matter: each change of the best trial whose
    removal costs less than `min_effect` of goodput (1%: the noise floor) is dropped
    (`tuner.prune.drop_noise_knobs`, on workload seeds of its own), and the confirmation runs what is left. With
    `engine_url` (or a live backend) the baseline is the config the engine actually runs (its tunables from
    GET /admin/config on top of the config file), so the proposal is measured against what it would replace."""
    slo = (slo or SLO()).validate()
    opts = (options or WL.WorkloadOptions()).validate()
    if confirm_seeds < 1:
        raise ValueError(f"confirm_seeds: must be >= 1, got {confirm_seeds}")
    out = Path(out_dir)
    prof = load_profile(profile)
    base = base_config(config_path, prof, backend)
    engine_url = engine_url or (live or {}).get("engine_url")
    running_note = None
    if engine_url:
        tunable, running_instance = running_tunables(engine_url, admin_token or (live or {}).get("admin_token"))
        base = base.with_tunable(tunable)
        running_note = f"baseline: the tunables running on {engine_url} (instance {running_instance})"
    space = load_space(space_path, base=base)
    db = open_db(db_url)
    try:
        instances = [instance] if instance else None
        factory, wdesc = workload_factory(workload, opts, profile=prof, base=base, db=db, instances=instances)
        be = make_backend(backend, profile=prof, workload=factory, db=db, slo=slo, live=live)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        name = f"nightly-{stamp}-{uuid.uuid4().hex[:4]}"
        if seeds_per_trial < 1:
            raise ValueError(f"seeds_per_trial: must be >= 1, got {seeds_per_trial}")
        result = run_study(
            be,
            space,
            base,
            name=name,
            trials=trials,
            slo=slo,
            seed=seed,
            workload_seed=list(range(seed, seed + seeds_per_trial)),
            storage=open_storage(db_url, storage_url=storage_url),
            progress=progress,
        )
        best, current = result.best, result.baseline
        if running_note:
            result.notes.append(running_note)
        confirmation = pruning = None
        kept: dict[str, Any] = {}
        if best is None:
            decision = "no proposal: no trial met the constraints"
        elif current is None:
            decision = "no proposal: the current config's trial did not complete"
        elif best.number == current.number:
            decision = "no proposal: the current config is already the best found"
        else:
            prune_seeds = [seed + 2000 + k for k in range(confirm_seeds)]
            measure = seed_measurer(be, space, base, slo=slo, seeds=prune_seeds, name=f"{name}-prune")
            kept, knobs = drop_noise_knobs(current.params, best.params, measure, min_effect=min_effect)
            pruning = {"seeds": prune_seeds, "min_effect": min_effect, "knobs": knobs}
            if kept == current.params:
                decision = "no proposal: no change of the best trial had an effect above the noise"
            else:
                best_cfg = space.apply(base, kept)
                seeds = [seed + 1000 + k for k in range(confirm_seeds)]
                confirmation = confirm(be, base, best_cfg, slo=slo, seeds=seeds, name=name, min_gain=min_gain)
                decision = (
                    f"propose: {confirmation['gain']:+.1%} goodput, held on {len(seeds)} new seeds"
                    if confirmation["holds"]
                    else f"no proposal: the gain did not hold on new seeds ({confirmation['gain']:+.1%})"
                )
        log.info("nightly %s: %s", name, decision)
        png = pareto_png(result)
        propose = confirmation is not None and confirmation["holds"]
        plot_name = f"pareto-{name}.png" if png else None
        md = render_markdown(
            result,
            title=f"kvpilot tuning report — {name}",
            workload=wdesc,
            backend=backend,
            confirmation=confirmation,
            decision=decision,
            plot_name=plot_name,
            pruning=pruning,
        )
        if not propose:
            path = _write_atomic(out / f"report-{name}.md", md.encode())
            if png:
                _write_atomic(out / plot_name, png)
            return NightlyResult(result, decision, None, confirmation, {"report": path}, md, pruning)
        best_cfg = space.apply(base, kept)
        cfg_yaml = best_cfg.to_yaml()
        metrics_base = {"trial": current.metrics, "confirmation": confirmation["baseline"], "params": current.params}
        metrics_best = {
            "trial": best.metrics,
            "params": kept,
            "patch": space.to_patch({k: v for k, v in kept.items() if current.params.get(k) != v}),
            "pruning": pruning,
            "search": search_summary(result),
            "workload": wdesc,
            "backend": backend,
            "confirmation": {k: v for k, v in confirmation.items() if k not in ("baseline", "best")}
            | {"runs": confirmation["best"]},
        }
        return _publish(
            db,
            out,
            name,
            instance,
            cfg_yaml,
            md,
            png,
            plot_name,
            metrics_base,
            metrics_best,
            result,
            decision,
            confirmation,
            pruning,
        )
    finally:
        db.dispose()


def _publish(
    db,
    out: Path,
    name: str,
    instance: str | None,
    cfg_yaml: str,
    md: str,
    png: bytes | None,
    plot_name: str | None,
    metrics_base: dict,
    metrics_best: dict,
    result: StudyResult,
    decision: str,
    confirmation: dict,
    pruning: dict | None = None,
) -> NightlyResult:
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    temps: list[Path] = []
    header = "# kvpilot tuning proposal — applies with `kvpilot engine serve --config` or `kvpilot tune apply`\n"
    try:
        tmp_cfg = out / f".proposal-{token}.yaml.tmp"
        tmp_cfg.write_text(header + cfg_yaml)
        temps.append(tmp_cfg)
        tmp_png = None
        if png:
            tmp_png = out / f".pareto-{token}.png.tmp"
            tmp_png.write_bytes(png)
            temps.append(tmp_png)
        row = create_proposal(
            db,
            config_yaml=header + cfg_yaml,
            report_md=md,
            study_name=name,
            instance=instance,
            baseline_metrics=metrics_base,
            best_metrics=metrics_best,
        )
    except BaseException:
        for t in temps:
            t.unlink(missing_ok=True)
        raise
    files = {"config": out / f"proposal-{row.id}.yaml", "report": out / f"report-{row.id}.md"}
    tmp_cfg.replace(files["config"])
    if tmp_png is not None and plot_name:
        files["plot"] = out / plot_name
        tmp_png.replace(files["plot"])
    _write_atomic(files["report"], md.encode())
    log.info("proposal %d written: %s", row.id, ", ".join(str(p) for p in files.values()))
    return NightlyResult(result, decision, row, confirmation, files, md, pruning)


def _write_atomic(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path
