"""Keep only the knobs whose change mattered: a found config, each changed knob in turn put back to the running
value, kept back when the goodput does not suffer. Works on any backend and any space (`apply`, `from_config`):
the simulator for the nightly kvpilot proposals and the screened vLLM search, where a knob costs one simulation.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tuner.backends import Backend, InfeasibleTrialError
from tuner.metrics import SLO, TrialMetrics, combine


def measure(backend: Backend, config: Any, *, seeds: Sequence[int], slo: SLO, name: str) -> TrialMetrics:
    """One config on every seed, scored together (rates averaged, tails the worst)."""
    runs = [backend.evaluate(config, run_id=f"{name}-s{s}-{uuid.uuid4().hex[:6]}", seed=s) for s in seeds]
    return combine(runs)


def prune(
    backend: Backend,
    space: Any,
    base: Any,
    params: dict[str, Any],
    *,
    seeds: Sequence[int],
    slo: SLO,
    tolerance: float = 0.01,
    name: str = "prune",
) -> tuple[dict[str, Any], list[str]]:
    """Keep only the knobs whose change matters: each changed knob in turn is put back to the running value, and
    stays back if the (simulated) goodput loses less than `tolerance` and the config stays feasible. Returns the
    pruned params and the knobs put back. Works for any space/config pair (`apply`, `from_config`)."""
    current = dict(params)
    running = space.from_config(base)

    def score(values: dict[str, Any]) -> tuple[float, bool]:
        m = measure(backend, space.apply(base, values), seeds=seeds, slo=slo, name=name)
        return m.goodput_tps, m.feasible(slo)

    reference, feasible = score(current)  # the candidate as the screen found it
    reverted: list[str] = []
    for knob in [k for k, v in params.items() if running.get(k) != v]:
        trial = {**current, knob: running[knob]}
        try:
            goodput, ok = score(trial)
        except (ValueError, InfeasibleTrialError):
            continue
        if not ok or (feasible and goodput < reference * (1.0 - tolerance)):
            continue  # this change matters: it stays
        if not feasible:
            reference = goodput  # the first feasible config sets the bar
        current, feasible = trial, True
        reverted.append(knob)
    return current, reverted
