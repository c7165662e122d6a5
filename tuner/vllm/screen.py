"""Simulation-screened search on a vLLM: screen hundreds of configs in the simulator, confirm the best few live,
and keep only what holds live on new workload seeds.

1. `screen`: an Optuna study on the simulator (`VllmSimBackend`, calibrated from the running config's stored
   steps) over the vLLM space; the `top_k` best feasible, distinct configs (the running one aside), each pruned
   in the simulator to the changes whose revert costs goodput on every seed and at least `min_effect` on
   average or misses the SLOs (`tuner.prune.drop_noise_knobs`, nightly's rule), are measured live on the same seeds
   (`VllmBackend`, one restart each). The search's best is the best feasible live measurement, the running
   config's included: a config the simulator liked but vLLM did not is never proposed.
   (`simulate` and `candidates` are its two halves without vLLM: what `kvpilot tune vllm screen` shows.)
2. `held_out`: the running config and the best one on new seeds, alternating seed by seed (and which goes first)
   with both servers kept up, so both see the machine at the same speed; the gain is the mean paired relative gain
   and `gain_low` its one-sided 90% lower bound (Student's t over the paired runs).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from integrations.vllm.config import VllmConfig
from tuner.backends import Backend, InfeasibleTrialError
from tuner.metrics import SLO, TrialMetrics, combine
from tuner.prune import drop_noise_knobs, seed_measurer
from tuner.study import StudyResult, run_study, tag_study
from tuner.vllm.space import VllmSpace

log = logging.getLogger("kvpilot.tuner.vllm.screen")

# one-sided 90% Student t quantiles by degrees of freedom (n - 1 paired runs)
_T90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 7: 1.415, 8: 1.397, 9: 1.383, 10: 1.372}


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
        feasible = [m for m in (self.baseline, *self.confirmed) if m.feasible]
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
) -> ScreenResult:
    """Screen `sim_trials` configs in the simulator, confirm the `top_k` best live (see the module docstring)."""
    sim = simulate(
        sim_backend,
        space,
        base,
        sim_trials=sim_trials,
        slo=slo,
        seeds=seeds,
        name=name,
        seed=seed,
        progress=progress,
        storage=storage,
        kind="study",
    )
    result = ScreenResult(sim=sim, baseline=baseline, min_effect=min_effect)
    picked = candidates(sim_backend, space, base, sim, slo=slo, seeds=seeds, name=name, min_effect=min_effect)
    for c in itertools.islice(picked, top_k):
        log.info(
            "confirming live: sim goodput %.1f, %s (put back: %s)", c.sim_goodput, base.changed(c.config), c.reverted
        )
        m = live_measurement(live_backend, c.config, c.params, seeds=seeds, slo=slo, name=f"{name}-confirm")
        m.sim_goodput, m.pruning = c.sim_goodput, c.pruning
        result.confirmed.append(m)
    return result


def paired_gain(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """(gain, one-sided 90% lower bound) of `after` over `before`, paired run by run."""
    if len(before) != len(after) or not before:
        raise ValueError("paired_gain: need as many runs before as after, at least one")
    gains = [(a / b - 1.0) if b > 0 else (0.0 if a == 0 else 1.0) for b, a in zip(before, after, strict=True)]
    mean = statistics.fmean(gains)
    if len(gains) < 2:
        return mean, float("-inf")
    t = _T90.get(len(gains) - 1, 1.28)
    return mean, mean - t * statistics.stdev(gains) / math.sqrt(len(gains))


def held_out(
    backend: Backend,
    base: VllmConfig,
    best: VllmConfig,
    *,
    seeds: Sequence[int],
    slo: SLO,
    name: str,
    repeats: int = 1,
    others: dict[str, VllmConfig] | None = None,
) -> dict[str, Any]:
    """Every config on every held-out seed, the order rotating from seed to seed; the figures with their spread.
    `others` (label -> config, e.g. another search's best) run alongside and are compared the same way."""
    configs = [("baseline", base), ("best", best), *(others or {}).items()]
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    order = 0
    for rep in range(repeats):
        for s in seeds:
            turn = configs[order % len(configs) :] + configs[: order % len(configs)]
            order += 1
            for label, cfg in turn:
                try:
                    m = backend.evaluate(
                        cfg, run_id=f"{name}-heldout-{label}-s{s}-r{rep}-{uuid.uuid4().hex[:4]}", seed=s
                    )
                    runs[label].append({**m.as_dict(), "seed": s, "feasible": m.feasible(slo)})
                except InfeasibleTrialError as exc:
                    runs[label].append({"seed": s, "goodput_tps": 0.0, "feasible": False, "infeasible": exc.reason})
    before = [r["goodput_tps"] for r in runs["baseline"]]
    after = [r["goodput_tps"] for r in runs["best"]]
    gain, gain_low = paired_gain(before, after)
    out = {
        "seeds": list(seeds),
        "repeats": repeats,
        **runs,
        "default_goodput": _spread(before),
        "proposal_goodput": _spread(after),
        "gain": gain,
        "gain_low": gain_low,
        "best_feasible_all": all(r["feasible"] for r in runs["best"]),
        "holds": gain_low > 0 and all(r["feasible"] for r in runs["best"]),
        "others": {},
    }
    for label in others or {}:
        values = [r["goodput_tps"] for r in runs[label]]
        g, low = paired_gain(before, values)
        out["others"][label] = {"goodput": _spread(values), "gain": g, "gain_low": low}
    return out


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
