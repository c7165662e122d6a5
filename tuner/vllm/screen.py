"""Simulation-screened search on a vLLM: screen hundreds of configs in the simulator, confirm the best few live,
and keep only what holds live on new workload seeds (`tuner.compare`, run by `tuner.vllm.tune`).

1. `screen`: an Optuna study on the simulator (`VllmSimBackend`, calibrated from the running config's stored
   steps) over the vLLM space; the `top_k` best feasible, distinct configs (the running one aside), each pruned
   in the simulator to the changes whose revert costs goodput on every seed and at least `min_effect` on
   average or misses the SLOs (`tuner.prune.drop_noise_knobs`, nightly's rule), are measured live on the same seeds
   (`VllmBackend`, one restart each). The search's best is the best feasible live confirmation: a config the
   simulator liked but vLLM did not is never proposed, and one that vLLM served within the SLOs always goes on to
   the held-out check, even when the running config measured more on the tuning seeds.
   (`simulate` and `candidates` are its two halves without vLLM: what `kvpilot tune vllm screen` shows.)
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from integrations.vllm.config import VllmConfig
from tuner.backends import Backend, InfeasibleTrialError, NotMeasuredError
from tuner.metrics import SLO, TrialMetrics, combine
from tuner.prune import drop_noise_knobs, seed_measurer
from tuner.study import StudyResult, run_study, tag_study
from tuner.vllm.space import VllmSpace

log = logging.getLogger("kvpilot.tuner.vllm.screen")


@dataclass
class LiveMeasurement:
    config: VllmConfig
    params: dict[str, Any]
    metrics: dict[str, Any] | None
    feasible: bool
    sim_goodput: float | None = None
    infeasible: str | None = None
    pruning: list[dict[str, Any]] = field(default_factory=list)  # drop_noise_knobs' record per changed knob

    @property
    def reverted(self) -> list[str]:
        """The knobs whose change the simulator found inside the noise: put back to the running value."""
        return [r["knob"] for r in self.pruning if not r["kept"]]

    @property
    def goodput(self) -> float:
        return float(self.metrics["goodput_tps"]) if self.metrics and self.feasible else 0.0


@dataclass
class ScreenResult:
    sim: StudyResult
    baseline: LiveMeasurement
    confirmed: list[LiveMeasurement] = field(default_factory=list)
    min_effect: float = 0.01  # the pruning's bar: the goodput a change's revert must cost on average

    @property
    def live_trials(self) -> int:
        """Live measurements the screened search made: the running config and each confirmation."""
        return 1 + len(self.confirmed)

    @property
    def sim_trials(self) -> int:
        return self.sim.measured

    @property
    def best(self) -> LiveMeasurement:
        """The candidate the held-out check compares with the running config: the best feasible live
        confirmation, even when the running config measured more on the tuning seeds (a few replays cannot
        settle that; the held-out check can). The running config only when no confirmation was feasible."""
        feasible = [m for m in self.confirmed if m.feasible]
        return max(feasible, key=lambda m: m.goodput) if feasible else self.baseline


def measure(backend: Backend, config: Any, *, seeds: Sequence[int], name: str) -> TrialMetrics:
    """One config on every seed, scored together (rates averaged, tails the worst)."""
    runs = [backend.evaluate(config, run_id=f"{name}-s{s}-{uuid.uuid4().hex[:6]}", seed=s) for s in seeds]
    return combine(runs)


def live_measurement(
    backend: Backend, config: VllmConfig, params: dict[str, Any], *, seeds: Sequence[int], slo: SLO, name: str
) -> LiveMeasurement:
    try:
        m = measure(backend, config, seeds=seeds, name=name)
    except InfeasibleTrialError as exc:
        log.warning("%s: infeasible live: %s", name, exc.reason)
        return LiveMeasurement(config, params, None, False, infeasible=exc.reason)
    except NotMeasuredError as exc:  # not the config's fault, but nothing to compare: never proposed
        log.warning("%s: %s", name, exc.reason)
        return LiveMeasurement(config, params, None, False, infeasible=exc.reason)
    return LiveMeasurement(config, params, m.as_dict(), m.feasible(slo))


@dataclass(frozen=True)
class Candidate:
    """A config the simulator ranks high, pruned to the changes that matter there."""

    config: VllmConfig
    params: dict[str, Any]
    sim_goodput: float
    pruning: list[dict[str, Any]]  # drop_noise_knobs' record per changed knob
    trial: int  # the simulated trial it was pruned from

    @property
    def reverted(self) -> list[str]:
        return [r["knob"] for r in self.pruning if not r["kept"]]


def simulate(
    sim_backend: Backend,
    space: VllmSpace,
    base: VllmConfig,
    *,
    sim_trials: int,
    slo: SLO,
    seeds: Sequence[int],
    name: str,
    seed: int = 0,
    progress: bool = False,
    storage: Any = None,
    kind: str = "screen",
) -> StudyResult:
    """The Optuna study over the space in the simulator (the running config is trial 0).

    With `storage` (the database's, `tuner.storage.open_storage`) the study is kept there, tagged with the
    engine (`vllm`) and what ran it (`kind`: a `screen`, or the screen of a `study`), so the dashboard's Tuning
    page lists it beside kvpilot's studies; without, it lives in memory."""
    result = run_study(
        sim_backend,
        space,
        base,
        name=f"{name}-sim",
        trials=sim_trials,
        slo=slo,
        storage=storage,
        seed=seed,
        workload_seed=list(seeds),
        random_baseline=False,
        progress=progress,
    )
    if storage is not None:
        tag_study(storage, f"{name}-sim", engine="vllm", kind=kind)
    return result


def candidates(
    sim_backend: Backend,
    space: VllmSpace,
    base: VllmConfig,
    sim: StudyResult,
    *,
    slo: SLO,
    seeds: Sequence[int],
    name: str,
    min_effect: float = 0.01,
) -> Iterator[Candidate]:
    """The simulated trials best first, each pruned; configs that prune to the running one or to an earlier
    candidate are skipped. Lazy: each candidate costs a few simulated replays (`drop_noise_knobs`)."""
    seen = {tuple(base.to_args())}
    running = space.from_config(base)
    sim_measure = seed_measurer(sim_backend, space, base, slo=slo, seeds=seeds, name=f"{name}-prune")
    ranked = sorted((t for t in sim.completed if t.feasible), key=lambda t: (-t.goodput, t.number))
    for trial in ranked:
        params, pruning = drop_noise_knobs(running, trial.params, sim_measure, min_effect=min_effect)
        config = space.apply(base, params)
        if tuple(config.to_args()) in seen:
            continue
        seen.add(tuple(config.to_args()))
        sim_goodput = measure(sim_backend, config, seeds=seeds, name=f"{name}-pruned").goodput_tps
        yield Candidate(config, params, sim_goodput, pruning, trial.number)


def screen(
    sim_backend: Backend,
    live_backend: Backend,
    space: VllmSpace,
    base: VllmConfig,
    *,
    baseline: LiveMeasurement,
    sim_trials: int,
    top_k: int,
    slo: SLO,
    seeds: Sequence[int],
    name: str,
    seed: int = 0,
    progress: bool = False,
    min_effect: float = 0.01,
    storage: Any = None,
    sim_slo: SLO | None = None,
) -> ScreenResult:
    """Screen `sim_trials` configs in the simulator, confirm the `top_k` best live (see the module docstring).
    `sim_slo` constrains the simulated trials (default `slo`; past capacity, `SLO.past_capacity`)."""
    sim_slo = slo if sim_slo is None else sim_slo
    sim = simulate(
        sim_backend,
        space,
        base,
        sim_trials=sim_trials,
        slo=sim_slo,
        seeds=seeds,
        name=name,
        seed=seed,
        progress=progress,
        storage=storage,
        kind="study",
    )
    result = ScreenResult(sim=sim, baseline=baseline, min_effect=min_effect)
    picked = candidates(sim_backend, space, base, sim, slo=sim_slo, seeds=seeds, name=name, min_effect=min_effect)
    for c in itertools.islice(picked, top_k):
        log.info(
            "confirming live: sim goodput %.1f, %s (put back: %s)", c.sim_goodput, base.changed(c.config), c.reverted
        )
        m = live_measurement(live_backend, c.config, c.params, seeds=seeds, slo=slo, name=f"{name}-confirm")
        m.sim_goodput, m.pruning = c.sim_goodput, c.pruning
        result.confirmed.append(m)
    return result
