"""Optuna studies as ask -> measure -> tell, the current config enqueued as trial 0.

Single-objective mode maximizes goodput (output tokens/s of requests meeting the TTFT and TPOT SLOs)
subject to constraints set with `trial.set_constraint` (no KV OOM, rejections under a rate, p99 TTFT
(and optionally p99 end-to-end) within the SLO). Multi-objective mode maximizes throughput and
minimizes p99 end-to-end latency under the same constraints and reports the Pareto front.
Every study can be paired with a random-search study of the same budget, so each report says how much
the sampler actually bought. Several workers may run one study on a shared RDB storage: each asks
until the study holds `trials` measured trials.

The budget counts measurements, not proposals. TPE re-proposes a configuration it already measured
(about one trial in five on a small discrete space); such a trial is told the stored result of the
first measurement on the same workload seeds instead of replaying the workload again, and is marked
`duplicate_of`. A study that keeps proposing only measured configurations has exhausted its space
and stops early with a note.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState
from tqdm import tqdm

from collector.errors import StorageError
from engine.config import ConfigError, EngineConfig
from tuner.backends import Backend, InfeasibleTrialError
from tuner.metrics import SLO, TrialMetrics, combine
from tuner.replay import ReplayError
from tuner.space import SearchSpace

log = logging.getLogger("kvpilot.tuner.study")
optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class TrialRecord:
    number: int
    params: dict[str, Any]
    patch: dict[str, Any]
    metrics: dict[str, Any] | None
    values: list[float] | None
    constraints: dict[str, float]
    feasible: bool
    state: str
    run_id: str | None = None
    baseline: bool = False
    duplicate_of: int | None = None  # told the stored result of that trial (same config, same seeds)
    infeasible: str | None = None  # why the engine could not run the config (refused, crashed, out of memory)

    @property
    def goodput(self) -> float:
        return float(self.metrics["goodput_tps"]) if self.metrics else 0.0


@dataclass
class StudyResult:
    name: str
    sampler: str
    multi_objective: bool
    trials: list[TrialRecord]
    failed: int = 0
    random: StudyResult | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def completed(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.state == "COMPLETE"]

    @property
    def baseline(self) -> TrialRecord | None:
        return next((t for t in self.trials if t.baseline and t.state == "COMPLETE"), None)

    @property
    def best(self) -> TrialRecord | None:
        """Best feasible trial: most goodput (single) / most throughput on the Pareto front (multi)."""
        feasible = [t for t in self.completed if t.feasible]
        if not feasible:
            return None
        if self.multi_objective:
            return max(pareto_front(feasible), key=lambda t: (t.values[0], -t.number))
        return max(feasible, key=lambda t: (t.goodput, -t.number))

    @property
    def pareto(self) -> list[TrialRecord]:
        feasible = [t for t in self.completed if t.feasible and t.values is not None]
        return sorted(pareto_front(feasible), key=lambda t: t.values[0]) if self.multi_objective else []

    @property
    def measured(self) -> int:
        """Trials that ran the workload (the budget): every trial but the duplicates told a stored result."""
        return sum(t.duplicate_of is None for t in self.trials)

    def best_so_far(self) -> list[float]:
        """Best feasible goodput after each measured trial, in trial order (the benchmark's convergence curve:
        its length is the number of measurements; a duplicate adds no measurement and no information)."""
        out, best = [], float("-inf")
        for t in sorted(self.trials, key=lambda t: t.number):
            if t.duplicate_of is not None:
                continue
            if t.state == "COMPLETE" and t.feasible:
                best = max(best, t.goodput)
            out.append(best)
        return out


def pareto_front(trials: list[TrialRecord]) -> list[TrialRecord]:
    """Trials no other trial dominates on (throughput up, p99 down)."""
    front = []
    for t in trials:
        thr, p99 = t.values[0], t.values[1]
        dominated = any(
            (o.values[0] >= thr and o.values[1] <= p99) and (o.values[0] > thr or o.values[1] < p99) for o in trials
        )
        if not dominated:
            front.append(t)
    return front


def _tpe(seed: int, startup: int, *, multivariate: bool) -> optuna.samplers.BaseSampler:
    """Every setting explicit: Optuna 5 changed TPE's defaults (multivariate and constant liar are now on)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup, multivariate=multivariate, constant_liar=multivariate
        )


# The samplers a study can use, by name; `kvpilot bench tuner` compares them all on its three landscapes and
# DEFAULT_SAMPLER is its choice (the rule and the figures: benchmarks/tuner_bench.py, docs/benchmarks.md). Every knob of
# the spaces is categorical, which rules out QMC and CMA-ES here (both hand categorical parameters to random sampling);
# Optuna's GPSampler needs scipy, which kvpilot does not depend on.
SAMPLERS: dict[str, str] = {
    "tpe": "TPE, multivariate with constant liar, 5 random start-up trials (10 from an 80-trial budget)",
    "tpe-startup10": "TPE, multivariate with constant liar, 10 random start-up trials (Optuna 5's defaults)",
    "tpe-startup3": "TPE, multivariate with constant liar, 3 random start-up trials",
    "tpe-independent": "TPE, one parameter at a time (Optuna 4's default), 10 random start-up trials",
    "random": "random search",
}
# `kvpilot bench tuner` (bench_version 2, full run of 2026-12-03): worst-case medians over the three profiles of
# measured trials to within 2% of the optimum: tpe-independent 15, tpe-startup10 16.5, tpe 17.5, tpe-startup3 19.5,
# random 41. The TPE variants are within seed noise of each other; random search is far behind on vLLM's landscape.
DEFAULT_SAMPLER = "tpe-independent"


def make_sampler(kind: str, *, seed: int, trials: int, multi_objective: bool) -> optuna.samplers.BaseSampler:
    if kind not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {kind!r}")
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "tpe-independent":
        return _tpe(seed, 10, multivariate=False)
    # Random start-up trials before TPE models the space: 5 for the default 40-trial budget, 10 from 80.
    startup = {"tpe": max(5, min(10, trials // 8)), "tpe-startup10": 10, "tpe-startup3": 3}[kind]
    return _tpe(seed, startup, multivariate=True)


def _objective_values(m: TrialMetrics, multi: bool) -> list[float]:
    if multi:
        return [m.throughput_tps, m.e2e_p99_s if m.e2e_p99_s is not None else 1e9]
    return [m.goodput_tps]


def _advance(bar: tqdm, total: int, best: float) -> None:
    """One more measurement: the bar stops at its total (failed trials count, as in the budget) and shows the
    best feasible goodput so far."""
    bar.n = min(bar.n + 1, total)
    bar.set_postfix_str(f"best {best:.1f} tok/s" if best > float("-inf") else "best —", refresh=False)
    bar.refresh()


def _record(ft: optuna.trial.FrozenTrial) -> TrialRecord:
    constraints = dict(ft.constraints)
    return TrialRecord(
        number=ft.number,
        params=dict(ft.params),
        patch=ft.user_attrs.get("patch", {}),
        metrics=ft.user_attrs.get("metrics"),
        values=list(ft.values) if ft.values is not None else None,
        constraints=constraints,
        feasible=ft.state == TrialState.COMPLETE and all(v <= 0 for v in constraints.values()),
        state=ft.state.name,
        run_id=ft.user_attrs.get("run_id"),
        baseline=bool(ft.user_attrs.get("baseline")),
        duplicate_of=ft.user_attrs.get("duplicate_of"),
        infeasible=ft.user_attrs.get("infeasible"),
    )


# A study whose sampler proposes this many measured configurations in a row has nothing new to try.
MAX_CONSECUTIVE_DUPLICATES = 50


def tunable_key(config: EngineConfig) -> str:
    """The effective tunables (after clamping) as one string: equal keys, equal configs to run."""
    return str(sorted((s, sorted(v.items())) for s, v in config.tunable().items()))


def _config_key(config: EngineConfig, seeds: Sequence[int]) -> str:
    """What makes two trials the same measurement: the same effective config on the same workload seeds."""
    return f"{tunable_key(config)} seeds={list(seeds)}"


def _measured_count(trials: Sequence[optuna.trial.FrozenTrial]) -> int:
    return sum("duplicate_of" not in t.user_attrs for t in trials)


def _stored_measurement(trials: Sequence[optuna.trial.FrozenTrial], key: str) -> optuna.trial.FrozenTrial | None:
    for ft in trials:
        if (
            ft.state == TrialState.COMPLETE
            and ft.user_attrs.get("config_key") == key
            and "duplicate_of" not in ft.user_attrs
        ):
            return ft
    return None


def tag_study(storage: Any, name: str, **attrs: str) -> None:
    """Label a stored study (its user attributes): which engine it tunes and what ran it, for the readers that
    list studies (the dashboard's Tuning page). A study without tags is kvpilot's engine's."""
    study = optuna.load_study(study_name=name, storage=storage)
    for key, value in attrs.items():
        study.set_user_attr(key, value)


def run_study(
    backend: Backend,
    space: SearchSpace,
    base: EngineConfig,
    *,
    name: str,
    trials: int,
    slo: SLO,
    storage: Any = None,
    sampler: str = DEFAULT_SAMPLER,
    seed: int = 0,
    workload_seed: int | Sequence[int] = 0,
    multi_objective: bool = False,
    random_baseline: bool = True,
    progress: bool = True,
) -> StudyResult:
    """Run (or join) the study `name` until it holds `trials` trials; then the random baseline.

    `workload_seed` may list several seeds: each trial then runs every one of them and is scored on the
    combination (mean goodput, worst tails), so the best config is not one that suits a single sample."""
    if trials < 1:
        raise ValueError(f"trials: must be >= 1, got {trials}")
    slo.validate()
    space = space.including(base)
    result = _run_one(
        backend,
        space,
        base,
        name=name,
        trials=trials,
        slo=slo,
        storage=storage,
        sampler=sampler,
        seed=seed,
        workload_seed=workload_seed,
        multi=multi_objective,
        progress=progress,
    )
    if random_baseline and sampler != "random":
        result.random = _run_one(
            backend,
            space,
            base,
            name=f"{name}-random",
            trials=trials,
            slo=slo,
            storage=storage,
            sampler="random",
            seed=seed,
            workload_seed=workload_seed,
            multi=multi_objective,
            progress=progress,
        )
    elif not random_baseline:
        result.notes.append("random-search baseline not run (disabled)")
    return result


def _run_one(
    backend: Backend,
    space: SearchSpace,
    base: EngineConfig,
    *,
    name: str,
    trials: int,
    slo: SLO,
    storage: Any,
    sampler: str,
    seed: int,
    workload_seed: int | Sequence[int],
    multi: bool,
    progress: bool,
) -> StudyResult:
    seeds = [workload_seed] if isinstance(workload_seed, int) else list(workload_seed)
    directions = ["maximize", "minimize"] if multi else ["maximize"]
    study = optuna.create_study(
        storage=storage if storage is not None else optuna.storages.InMemoryStorage(),
        study_name=name,
        directions=directions,
        sampler=make_sampler(sampler, seed=seed, trials=trials, multi_objective=multi),
        load_if_exists=True,
    )
    if list(study.directions) != [
        optuna.study.StudyDirection.MAXIMIZE if d == "maximize" else optuna.study.StudyDirection.MINIMIZE
        for d in directions
    ]:
        raise ValueError(f"study {name!r} exists with other objectives; pick another --study-name")
    if not study.trials:
        study.set_user_attr("backend", backend.name)
        study.set_user_attr("sampler", sampler)
        study.set_user_attr("space", space.describe())
        study.set_user_attr("base_config", base.tunable())
        study.enqueue_trial(space.from_config(base), user_attrs={"baseline": True}, skip_if_exists=True)
    failed = duplicates_in_a_row = 0
    best = float("-inf")  # best feasible goodput measured by this worker (the bar's postfix)
    notes: list[str] = []
    initial = _measured_count(study.get_trials(deepcopy=False))
    with tqdm(
        total=trials,
        initial=min(trials, initial),
        desc=f"{name} [{sampler}]",
        unit="trial",
        disable=not progress,
        leave=False,
    ) as bar:
        while True:
            so_far = study.get_trials(deepcopy=False)  # one read per trial: the budget and the duplicate lookup
            measured = _measured_count(so_far)
            if measured >= trials:
                break
            if duplicates_in_a_row >= MAX_CONSECUTIVE_DUPLICATES:
                notes.append(
                    f"stopped after {measured} measured trials: the sampler proposed "
                    f"{duplicates_in_a_row} already measured configurations in a row (space exhausted)"
                )
                log.warning("study %s: %s", name, notes[-1])
                break
            trial = study.ask()
            values = space.suggest(trial)
            try:
                config = space.apply(base, values)
            except ConfigError as exc:
                log.error("trial %d: params %s make no valid config: %s", trial.number, values, exc)
                study.tell(trial, state=TrialState.FAIL)
                failed += 1
                _advance(bar, trials, best)
                continue
            config_key = _config_key(config, seeds)
            trial.set_user_attr("patch", space.to_patch(values))
            trial.set_user_attr("config_key", config_key)
            stored = _stored_measurement(so_far, config_key)
            if stored is not None:
                for attr in ("metrics", "run_id", "infeasible"):
                    trial.set_user_attr(attr, stored.user_attrs.get(attr))
                trial.set_user_attr("duplicate_of", stored.number)
                for ckey, value in stored.constraints.items():
                    trial.set_constraint(ckey, value)
                study.tell(trial, list(stored.values))
                duplicates_in_a_row += 1
                log.debug("trial %d repeats trial %d's config; told its stored result", trial.number, stored.number)
                continue
            duplicates_in_a_row = 0
            run_id = f"{name}-t{trial.number}-{uuid.uuid4().hex[:6]}"
            trial.set_user_attr("run_id", run_id)
            try:
                runs = [
                    backend.evaluate(config, run_id=run_id if len(seeds) == 1 else f"{run_id}-s{s}", seed=s)
                    for s in seeds
                ]
                metrics = combine(runs)
            except InfeasibleTrialError as exc:
                # the config's own fault: a measured, infeasible trial (the sampler learns to avoid it)
                log.warning(
                    "trial %d (%s) infeasible on backend %s: %s", trial.number, run_id, backend.name, exc.reason
                )
                trial.set_user_attr("infeasible", exc.reason[:2000])
                trial.set_constraint("infeasible", 1.0)
                study.tell(trial, [0.0, 1e9] if multi else [0.0])
                _advance(bar, trials, best)
                continue
            except (ReplayError, StorageError, ConfigError, RuntimeError, OSError) as exc:
                log.error("trial %d (%s) failed on backend %s: %s", trial.number, run_id, backend.name, exc)
                study.tell(trial, state=TrialState.FAIL)
                failed += 1
                _advance(bar, trials, best)
                continue
            trial.set_user_attr("metrics", metrics.as_dict())
            if metrics.run_id != run_id:  # the simulator's cache: the events are stored under the first run
                trial.set_user_attr("run_id", metrics.run_id)
            for key, value in metrics.constraints(slo).items():
                trial.set_constraint(key, value)
            study.tell(trial, _objective_values(metrics, multi))
            if metrics.feasible(slo) and not multi:
                best = max(best, metrics.goodput_tps)
            _advance(bar, trials, best)
    records = [_record(t) for t in study.get_trials(deepcopy=False)]
    if failed:
        log.warning("study %s: %d trial(s) failed (see errors above)", name, failed)
    dups = sum(r.duplicate_of is not None for r in records)
    if dups:
        notes.append(f"{dups} proposal(s) repeated an already measured config and were told its stored result")
    return StudyResult(
        name=name,
        sampler=sampler,
        multi_objective=multi,
        trials=records,
        failed=sum(r.state == "FAIL" for r in records),
        notes=notes,
    )
