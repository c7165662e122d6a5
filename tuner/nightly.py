"""`kvpilot tune nightly`: kvpilot's engine through the one tuning pipeline (`tuner.pipeline`): the running
config's SLO capacity, a study on the stored traffic as it came (+ a random baseline), the best trial pruned to
the changes that matter, the capacity comparison on held-out seeds, and a proposal only when it says `proposal`.

The comparison is the one `kvpilot tune vllm` makes (`tuner.compare`, one gain rule for every engine): each
config's SLO capacity on held-out seeds (`tuner.capacity`: how many times the traffic's rate it serves within
the SLOs), measured in ABBA pairs, and the 90% interval of the capacity ratio; the gain holds when the verdict is
`proposal` (the whole interval above 1, and reaching past the margin). The study ranks its trials by goodput
at the traffic's rate, as before; what a proposal claims is capacity: "+X% traffic at the same SLOs".

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

from tuner import pipeline
from tuner import workloads as WL
from tuner.backends import Backend
from tuner.capacity import MIN_MULTIPLIER, Capacity, Replayer, arrival_rate, replay_capacity
from tuner.compare import DEFAULT_MARGIN, MAX_PAIRS, Comparison, ReplayerSide, compare
from tuner.jobs import base_config, make_backend, open_db, workload_factory
from tuner.metrics import SLO
from tuner.pipeline import Choice, Verdict
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


def capacity_backend(backend: Backend) -> CapacityBackend:
    """`backend` as one whose capacity can be searched; ValueError naming it when it cannot replay a request list."""
    if not isinstance(backend, CapacityBackend):
        raise ValueError(f"backend {backend.name}: cannot replay a request list, so it cannot measure capacity")
    return backend


@dataclass
class NightlyResult:
    study: StudyResult
    decision: str
    proposal: ProposalView | None
    confirmation: dict[str, Any] | None
    files: dict[str, Path] = field(default_factory=dict)
    report_md: str = ""
    pruning: dict[str, Any] | None = None  # the changes kept and dropped (effect inside the noise)
    verdict: Verdict | None = None  # the pipeline's: the running config's capacity, headroom, phase times

    def lines(self) -> list[str]:
        """The outcome as `kvpilot tune nightly` and the demo print it: the decision, the running config's
        capacity and headroom, each change of the best trial kept or dropped, the files written."""
        lines = [self.decision]
        if self.verdict is not None:
            c = self.verdict.running
            within = f"{c.capacity_rps:.2f} req/s within the SLOs (x{c.multiplier:.2f} the traffic)"
            lines.append(f"  running config: {within}")
            lines += [f"  {note}" for note in self.verdict.notes]
        for knob in (self.pruning or {}).get("knobs", []):
            verdict = "kept" if knob["kept"] else "dropped (inside the noise)"
            lines.append(
                f"  {knob['knob']}: {knob['current']} -> {knob['proposed']}, reverting it costs "
                f"{knob['effect']:+.1%} goodput: {verdict}"
            )
        lines += [f"  {kind}: {path}" for kind, path in self.files.items()]
        if self.proposal is not None:
            lines.append(f"  proposal id {self.proposal.id} (pending): kvpilot tune apply {self.proposal.id}")
        return lines


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
    start: float = 1.0,
) -> Comparison:
    """The capacity comparison of `best` against `base` on the held-out `seeds` (module docstring): ABBA pairs,
    one per seed at most, at least 2 (its record, `Comparison.as_dict`, is the proposal's). `start`: where each
    seed's first measurement starts (the running config's known capacity, as a multiple of the traffic's rate)."""
    if len(seeds) < 2:
        raise ValueError(f"seeds: the comparison needs at least 2 held-out seeds (one pair has no interval): {seeds}")
    replayer = capacity_backend(backend)

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
        start=start,
        min_pairs=2,
        max_pairs=min(len(seeds), MAX_PAIRS),
        margin=margin,
        floor_rps=MIN_MULTIPLIER * rate,
    )
    log.info("nightly %s: confirmation: %s", name, c.sentence())
    return c


NIGHTLY_CAPACITY_REPLAYS = 7  # the running config's capacity search (the baseline phase)


@dataclass
class KvpilotTarget:
    """kvpilot's engine through any of its backends as a `tuner.pipeline` target: the running config's capacity,
    an Optuna study (the running config its first trial, a random search beside it), the best trial pruned to the
    changes that matter, the capacity comparison on held-out seeds, and the report and proposal files."""

    backend: Backend
    backend_name: str
    space: Any
    base: Any
    slo: SLO
    name: str
    db: Any
    out: Path
    workload: dict[str, Any]
    trials: int = 40
    seed: int = 0
    seeds_per_trial: int = 1
    confirm_seeds: int = 3
    margin: float = DEFAULT_MARGIN
    min_effect: float = 0.01
    instance: str | None = None
    storage: Any = None
    progress: bool = True
    notes: list[str] = field(default_factory=list)
    running: Capacity | None = None  # the baseline phase's
    result: StudyResult | None = None
    pruning: dict[str, Any] | None = None
    kept: dict[str, Any] = field(default_factory=dict)

    def baseline(self) -> Capacity:
        """The running config's SLO capacity on the first tuning seed."""
        be = capacity_backend(self.backend)
        reqs, prompts = be.requests(self.seed)
        run_id = f"{self.name}-capacity-running"
        cap = replay_capacity(
            be, self.base, reqs, prompts, slo=self.slo, run_id=run_id, max_replays=NIGHTLY_CAPACITY_REPLAYS
        )
        log.info(
            "nightly %s: the running config's capacity %.2f req/s (x%.2f)", self.name, cap.capacity_rps, cap.multiplier
        )
        self.running = cap
        return cap

    def screen(self) -> None:
        self.result = run_study(
            self.backend,
            self.space,
            self.base,
            name=self.name,
            trials=self.trials,
            slo=self.slo,
            seed=self.seed,
            workload_seed=list(range(self.seed, self.seed + self.seeds_per_trial)),
            storage=self.storage,
            progress=self.progress,
        )
        self.result.notes.extend(self.notes)

    def confirm(self) -> Choice:
        """The best trial, each change whose revert costs less than `min_effect` of goodput dropped (on workload
        seeds of their own: `tuner.prune.drop_noise_knobs`)."""
        result = self._result()
        best, current = result.best, result.baseline
        if best is None:
            return Choice(None, "no trial met the constraints")
        if current is None:
            return Choice(None, "the current config's trial did not complete")
        if best.number == current.number:
            return Choice(None, "the current config is already the best found")
        prune_seeds = [self.seed + 2000 + k for k in range(self.confirm_seeds)]
        measure = seed_measurer(
            self.backend, self.space, self.base, slo=self.slo, seeds=prune_seeds, name=f"{self.name}-prune"
        )
        self.kept, knobs = drop_noise_knobs(current.params, best.params, measure, min_effect=self.min_effect)
        self.pruning = {"seeds": prune_seeds, "min_effect": self.min_effect, "knobs": knobs}
        if self.kept == current.params:
            return Choice(None, "no change of the best trial had an effect above the noise")
        return Choice(self.space.apply(self.base, self.kept))

    def held_out(self, candidate: Any) -> Comparison:
        seeds = [self.seed + 1000 + k for k in range(self.confirm_seeds)]
        known = self.running.warm_start if self.running is not None else 1.0
        return confirm(
            self.backend,
            self.base,
            candidate,
            slo=self.slo,
            seeds=seeds,
            name=self.name,
            margin=self.margin,
            start=known,
        )

    def _result(self) -> StudyResult:
        if self.result is None:
            raise RuntimeError("screen first")
        return self.result

    def finish(self, verdict: Verdict) -> NightlyResult:
        """The report (every night) and the proposal (only when the verdict says so), written all or nothing."""
        result = self._result()
        comparison = verdict.comparison.as_dict() if verdict.comparison is not None else None
        png = pareto_png(result)
        plot_name = f"pareto-{self.name}.png" if png else None
        md = render_markdown(
            result,
            title=f"kvpilot tuning report — {self.name}",
            workload=self.workload,
            backend=self.backend_name,
            confirmation=comparison,
            decision=verdict.decision,
            plot_name=plot_name,
            pruning=self.pruning,
            running_capacity=verdict.running.summary(),
            notes=verdict.notes,
        )
        if not verdict.propose or comparison is None:
            path = _write_atomic(self.out / f"report-{self.name}.md", md.encode())
            if png and plot_name:
                _write_atomic(self.out / plot_name, png)
            files = {"report": path}
            return NightlyResult(result, verdict.decision, None, comparison, files, md, self.pruning, verdict)
        best, current = result.best, result.baseline
        assert best is not None and current is not None and verdict.candidate is not None  # a proposal has all three
        metrics_base = {
            "trial": current.metrics,
            "capacity": verdict.running.summary(),
            "heldout_capacity_rps": comparison["running_capacity_rps"],
            "params": current.params,
        }
        metrics_best = {
            "trial": best.metrics,
            "params": self.kept,
            "patch": self.space.to_patch({k: v for k, v in self.kept.items() if current.params.get(k) != v}),
            "pruning": self.pruning,
            "search": search_summary(result),
            "workload": self.workload,
            "backend": self.backend_name,
            "heldout_capacity_rps": comparison["candidate_capacity_rps"],
            "confirmation": comparison,
        }
        return _publish(
            self.db,
            self.out,
            self.name,
            self.instance,
            verdict.candidate.to_yaml(),
            md,
            png,
            plot_name,
            metrics_base,
            metrics_best,
            result,
            verdict,
            comparison,
            self.pruning,
        )


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
    """The whole nightly job (`tuner.pipeline` over a `KvpilotTarget`); the proposal is None when the gain did not
    hold.

    The proposal changes only the knobs that measurably matter: each change of the best trial whose
    removal costs less than `min_effect` of goodput (1%: the noise floor) is dropped
    (`tuner.prune.drop_noise_knobs`, on workload seeds of its own), and the comparison runs what is left. With
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
    if seeds_per_trial < 1:
        raise ValueError(f"seeds_per_trial: must be >= 1, got {seeds_per_trial}")
    prof = load_profile(profile)
    base = base_config(config_path, prof, backend)
    engine_url = engine_url or (live or {}).get("engine_url")
    notes = []
    if engine_url:
        tunable, running_instance = running_tunables(engine_url, admin_token or (live or {}).get("admin_token"))
        base = base.with_tunable(tunable)
        notes.append(f"baseline: the tunables running on {engine_url} (instance {running_instance})")
    space = load_space(space_path, base=base)
    db = open_db(db_url)
    try:
        instances = [instance] if instance else None
        factory, wdesc = workload_factory(workload, opts, profile=prof, base=base, db=db, instances=instances)
        be = make_backend(backend, profile=prof, workload=factory, db=db, slo=slo, live=live)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        target = KvpilotTarget(
            backend=be,
            backend_name=backend,
            space=space,
            base=base,
            slo=slo,
            name=f"nightly-{stamp}-{uuid.uuid4().hex[:4]}",
            db=db,
            out=Path(out_dir),
            workload=wdesc,
            trials=trials,
            seed=seed,
            seeds_per_trial=seeds_per_trial,
            confirm_seeds=confirm_seeds,
            margin=margin,
            min_effect=min_effect,
            instance=instance,
            storage=open_storage(db_url, storage_url=storage_url),
            progress=progress,
            notes=notes,
        )
        return pipeline.run(target)
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
    verdict: Verdict,
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
    return NightlyResult(result, verdict.decision, row, confirmation, files, md, pruning, verdict)


def _write_atomic(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path
