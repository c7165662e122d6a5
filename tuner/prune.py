"""Keep only the knobs whose change measurably matters: a found config's changes, each reverted alone, dropped
when the effect of the change is inside the noise. One procedure for the nightly kvpilot proposals
(`tuner.nightly`) and the screened vLLM search (`tuner.vllm.screen`); it works on any backend and any space
(`apply`, `from_config`), and each knob costs one measurement per seed (one simulation on the simulator).
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import ConfigError
from tuner.backends import Backend, InfeasibleTrialError
from tuner.metrics import SLO

# params -> (goodput, feasible) on each of a fixed list of workload seeds
Measure = Callable[[dict[str, Any]], list[tuple[float, bool]]]


def drop_noise_knobs(
    current: dict[str, Any], best: dict[str, Any], measure: Measure, *, min_effect: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`best` with every change whose effect is inside the noise put back to its `current` value.

    A study's best trial changes every knob the sampler happened to move, most of them for nothing.
    One changed knob at a time, the candidate is measured with that knob back at its current value
    (`measure(params)` -> [(goodput, feasible)] on fixed workload seeds): the change stays only when
    reverting it costs goodput on every seed and at least `min_effect` of it on average, or makes a
    seed miss the SLOs. Otherwise it is dropped and the next knob is judged against the smaller
    candidate. Returns the params kept and one record per changed knob."""
    candidate = dict(best)
    ref = measure(candidate)
    records: list[dict[str, Any]] = []
    for knob in [k for k, v in best.items() if current.get(k) != v]:
        trial = {**candidate, knob: current[knob]}
        runs = measure(trial)
        before, after = [g for g, _ in ref], [g for g, _ in runs]
        mean_ref = statistics.fmean(before)
        effect = 1.0 - statistics.fmean(after) / mean_ref if mean_ref > 0 else 0.0
        slo = all(f for _, f in ref) and not all(f for _, f in runs)
        keep = slo or (effect >= min_effect and all(a < b for a, b in zip(after, before, strict=True)))
        records.append(
            {"knob": knob, "current": current[knob], "proposed": best[knob], "effect": effect, "slo": slo, "kept": keep}
        )
        if not keep:
            candidate, ref = trial, runs
    return candidate, records


def seed_measurer(backend: Backend, space: Any, base: Any, *, slo: SLO, seeds: Sequence[int], name: str) -> Measure:
    """The measuring side of `drop_noise_knobs` on `backend`: params -> (goodput, feasible) on each of `seeds`.

    A config that cannot run — the space or the engine refuses it (ConfigError), or the backend finds it
    infeasible (a vLLM that will not start) — scores zero and misses the SLOs on every seed: a change whose
    revert cannot run is needed, so it stays."""

    def measure(params: dict[str, Any]) -> list[tuple[float, bool]]:
        try:
            config = space.apply(base, params)
            runs = [backend.evaluate(config, run_id=f"{name}-s{s}-{uuid.uuid4().hex[:6]}", seed=s) for s in seeds]
        except (ConfigError, InfeasibleTrialError):
            return [(0.0, False) for _ in seeds]
        return [(m.goodput_tps, m.feasible(slo)) for m in runs]

    return measure
