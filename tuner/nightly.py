"""`kvpilot tune nightly`: the stored traffic as it came -> study (+ random baseline) -> confirmation of the
current and the best config on new workload seeds -> a proposal only when the gain holds.

The confirmation is the comparison `kvpilot tune vllm` makes (`tuner.compare`, one gain rule for every engine):
each config's SLO capacity on held-out seeds (`tuner.capacity`: how many times the traffic's rate it serves
within the SLOs), measured in ABBA pairs, and the 90% interval of the capacity ratio; the gain holds when the
verdict is `proposal` (the whole interval above 1, and above the equivalence margin). The study ranks its trials
by goodput at the traffic's rate, as before; what a proposal claims is capacity: "+X% traffic at the same SLOs".

A proposal is three files and a row: `proposal-<id>.yaml` (an EngineConfig: `kvpilot engine serve
--config` applies it), `report-<id>.md`, `pareto-<id>.png`, and a `proposals` row (status pending).
Everything is rendered in memory and written to temporary names first; the row is committed, then the
files are renamed into place, so a failure leaves neither a row without files nor files without a row.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tuner import workloads as WL
from tuner.backends import Backend
from tuner.capacity import MIN_MULTIPLIER, Replayer, arrival_rate
from tuner.compare import DEFAULT_MARGIN, MAX_PAIRS, ReplayerSide, compare
from tuner.jobs import base_config, make_backend, open_db, workload_factory
from tuner.metrics import SLO
from tuner.profile import load_profile
from tuner.proposals import ProposalView, create_proposal, running_tunables
from tuner.prune import drop_noise_knobs, seed_measurer
from tuner.replay import Prepared
from tuner.report import pareto_png, render_markdown, search_summary
from tuner.space import load_space
from tuner.storage import open_storage
from tuner.study import StudyResult, run_study

log = logging.getLogger("kvpilot.tuner.nightly")


@runtime_checkable
class CapacityBackend(Replayer, Protocol):
    """A backend whose capacity can be searched: it replays any request list and has each seed's workload (the
    simulators, the in-process engine, a live kvpilot engine, a vLLM)."""

    name: str

    def requests(self, seed: int) -> Prepared: ...


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
    backend: Backend,
    base: Any,
    best: Any,
    *,
    slo: SLO,
    seeds: list[int],
    name: str,
    margin: float = DEFAULT_MARGIN,
    pair_replays: int = 4,
    scout_replays: int = 8,
) -> dict[str, Any]:
    """The capacity comparison of `best` against `base` on the held-out `seeds` (module docstring): ABBA pairs,
    one per seed at most, at least 2; the record is the comparison's (`Comparison.as_dict`: `holds` when the
    verdict is `proposal`)."""
    if len(seeds) < 2:
        raise ValueError(f"seeds: the comparison needs at least 2 held-out seeds (one pair has no interval): {seeds}")
    if not isinstance(backend, CapacityBackend):
        raise ValueError(f"backend {backend.name}: cannot replay a request list, so it cannot measure capacity")
    replayer: CapacityBackend = backend  # the narrowed type, for the closure below

    def side(label: str, config: Any) -> ReplayerSide:
        return ReplayerSide(
            label, replayer, config, replayer.requests, slo, f"{name}-confirm", max_replays=pair_replays,
            scout_replays=scout_replays,
        )  # fmt: skip

    rate = arrival_rate(replayer.requests(seeds[0])[0])
    c = compare(
        side("running", base),
        side("candidate", best),
        seeds=seeds,
        start=1.0,
        min_pairs=2,
        max_pairs=min(len(seeds), MAX_PAIRS),
        margin=margin,
        floor_rps=MIN_MULTIPLIER * rate,
    )
    log.info("nightly %s: confirmation: %s", name, c.sentence())
    return c.as_dict()


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
    margin: float = DEFAULT_MARGIN,
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
    if not 2 <= confirm_seeds <= MAX_PAIRS:
        raise ValueError(
            f"confirm_seeds: must be within 2..{MAX_PAIRS}, got {confirm_seeds}: the confirmation's interval needs "
            "at least 2 held-out seeds"
        )
    if not 0 <= margin < 0.5:
        raise ValueError(f"margin: must be within [0, 0.5), got {margin}")
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
                confirmation = confirm(be, base, best_cfg, slo=slo, seeds=seeds, name=name, margin=margin)
                decision = (
                    f"propose: {confirmation['sentence']}"
                    if confirmation["holds"]
                    else f"no proposal: the gain did not hold on {len(seeds)} new seeds: {confirmation['sentence']}"
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
        metrics_base = {
            "trial": current.metrics,
            "heldout_capacity_rps": confirmation["running_capacity_rps"],
            "params": current.params,
        }
        metrics_best = {
            "trial": best.metrics,
            "params": kept,
            "patch": space.to_patch({k: v for k, v in kept.items() if current.params.get(k) != v}),
            "pruning": pruning,
            "search": search_summary(result),
            "workload": wdesc,
            "backend": backend,
            "heldout_capacity_rps": confirmation["candidate_capacity_rps"],
            "confirmation": confirmation,
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
