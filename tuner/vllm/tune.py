"""One screened tuning of a vLLM, from the config it runs to a proposal: what `kvpilot tune vllm study` runs and
`kvpilot bench tune-vllm` measures (the bench adds its live-only search between `screen` and `held_out`).

`VllmTuning` runs the phases in order on one `VllmBackend`, the running config's server pinned (kept up):
1. `capacity_rps`: for a scenario workload, the running config's requests/s, live (the scenario mix all at once);
2. `measure_baseline`: the running config live on the tuning seeds;
3. `calibrate`: the simulator's cost model from the steps the collector stored for those replays, and for
   `steps_instances` (e.g. the operator's own vLLM) since `steps_since`;
4. `screen`: `sim_trials` configs in the simulator, the `top_k` best confirmed live (`tuner.vllm.screen`);
5. `held_out`: the running config against the best on new seeds (`run` skips it when the best is the running one);
6. `finish`: the decision, the markdown report, and a proposal (vLLM `--config` file, report, row) only when the
   gain's one-sided 90% lower bound is above zero and the best was feasible on every held-out run.

`preview` is the screen without vLLM: the simulator calibrated from what the collector already stores, and the
best configs it finds with their predicted goodput, so an operator can look before paying for restarts.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from collector.queries import StoredStep, stored_steps
from engine import workload as W
from engine.config import ModelConfig
from integrations.vllm.config import VllmConfig, VllmConfigError
from tuner import workloads as WL
from tuner.backends import InfeasibleTrialError
from tuner.metrics import SLO, TrialMetrics
from tuner.replay import TrialSink, replay
from tuner.study import StudyResult
from tuner.vllm.backend import VllmBackend
from tuner.vllm.calibrate import MIN_STEPS, CalibrationError, VllmProfile, fit_profile
from tuner.vllm.proposal import VllmProposal, publish, render_report
from tuner.vllm.screen import (
    Candidate,
    LiveMeasurement,
    ScreenResult,
    candidates,
    held_out,
    live_measurement,
    screen,
    simulate,
)
from tuner.vllm.sim import VllmSimBackend, sim_vllm_engine
from tuner.vllm.space import VllmSpace

Say = Callable[[str], None]
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


class TuneError(RuntimeError):
    """The tuning cannot go on: the running config itself did not serve, or its measurements never reached the
    database. (A trial config that vLLM refuses is an infeasible trial, not this.)"""


# Bounds on a tuning's size: a simulated config costs ~0.2 s here, a live one a vLLM restart (~1-2 min) per seed.
MAX_SIM_TRIALS = 5000
MAX_LIVE = 10  # confirmed candidates, and tuning seeds
MAX_HELDOUT = 20  # held-out seeds
MAX_REPEATS = 5


@dataclass(frozen=True)
class Budget:
    tuning_seeds: tuple[int, ...] = (0,)
    sim_trials: int = 200
    top_k: int = 2
    heldout_seeds: tuple[int, ...] = (1000, 1001, 1002)
    repeats: int = 1
    min_effect: float = 0.01  # a simulated change stays only if its revert costs this much goodput (the pruning)

    def validate(self) -> Budget:
        if not self.tuning_seeds:
            raise ValueError("tuning_seeds: at least one")
        if self.sim_trials < 1:
            raise ValueError(f"sim_trials: must be >= 1, got {self.sim_trials}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not self.heldout_seeds or self.repeats < 1:
            raise ValueError("heldout_seeds: at least one, and repeats >= 1")
        for name, value, most in (
            ("sim_trials", self.sim_trials, MAX_SIM_TRIALS),
            ("top_k", self.top_k, MAX_LIVE),
            ("tuning_seeds", len(self.tuning_seeds), MAX_LIVE),
            ("heldout_seeds", len(self.heldout_seeds), MAX_HELDOUT),
            ("repeats", self.repeats, MAX_REPEATS),
        ):
            if value > most:
                raise ValueError(f"{name}: at most {most}, got {value}")
        if set(self.heldout_seeds) & set(self.tuning_seeds):
            raise ValueError(
                f"heldout_seeds: {sorted(set(self.heldout_seeds) & set(self.tuning_seeds))} are tuning seeds"
            )
        return self


def checkpoint_model(path: str | Path, dtype: str) -> ModelConfig:
    """The model's shape from a local checkpoint (config.json) in vLLM's `--dtype`: what sizes its KV blocks."""
    from engine.weights import CheckpointError, config_from_checkpoint

    path = Path(path)
    if not path.is_dir():
        raise VllmConfigError(f"model: {path} is not a directory (a local checkpoint with config.json)", "model")
    ours = _DTYPES.get(dtype)
    if ours is None and dtype == "auto":
        import json

        try:
            declared = json.loads((path / "config.json").read_text()).get("torch_dtype") or "float32"
        except (OSError, ValueError):
            declared = "float32"
        ours = _DTYPES.get(str(declared), "float32")
    if ours is None:
        raise VllmConfigError(f"dtype: {dtype!r} is not one of {', '.join([*_DTYPES, 'auto'])}", "dtype")
    try:
        model, _ = config_from_checkpoint(path, ModelConfig(dtype=ours))
    except (CheckpointError, ValueError) as exc:
        raise VllmConfigError(f"model: {exc}", "model") from exc
    return model


def calibrate_from_store(
    db: Engine,
    *,
    model: ModelConfig,
    block_size: int,
    start: float,
    end: float,
    run_ids: Sequence[str] = (),
    instances: Sequence[str] = (),
    min_steps: int = MIN_STEPS,
) -> VllmProfile:
    """The cost model from the stored steps of these runs and of these instances in `start`..`end` (each step
    once); CalibrationError, saying how many there are and how many are needed, when too few."""
    found: dict[tuple, StoredStep] = {}
    if run_ids:
        for s in stored_steps(db, start=start, end=end, run_ids=list(run_ids)):
            found[(s.instance, s.run_id, s.step, s.ts)] = s
    if instances:
        for s in stored_steps(db, start=start, end=end, instances=list(instances)):
            found[(s.instance, s.run_id, s.step, s.ts)] = s
    steps = sorted(found.values(), key=lambda s: (s.instance, s.run_id or "", s.step, s.ts))
    sources = [f"runs {', '.join(run_ids)}"] if run_ids else []
    sources += [f"instance(s) {', '.join(instances)}"] if instances else []
    where = " and ".join(sources) or "nothing"
    try:
        return fit_profile(steps, model=model, block_size=block_size, min_steps=min_steps)
    except CalibrationError as exc:
        raise CalibrationError(f"calibration from the stored steps of {where}: {exc}") from exc


def sim_capacity_rps(profile: VllmProfile, config: VllmConfig, reqs: list[W.WorkloadRequest]) -> float:
    """Requests/s `config` sustains in the simulator: `reqs` all at once, finished over the time it took."""
    engine, _ = sim_vllm_engine(config, profile, sink=TrialSink(keep_steps=False))
    result = replay(engine, reqs)
    if not result.finished or result.duration_s <= 0:
        raise WL.WorkloadError("capacity", "the simulated capacity run finished no request")
    return len(result.finished) / result.duration_s


def changes(base: VllmConfig, config: VllmConfig) -> dict[str, Any]:
    return {k: b for k, _a, b in base.changed(config)}


def _label(base: VllmConfig, config: VllmConfig) -> str:
    diff = changes(base, config)
    return ", ".join(f"{k}={v}" for k, v in diff.items()) if diff else "the running config"


class LateWorkload:
    """seed -> requests from a factory known only once the running config's capacity was measured on the backend
    that replays it (`workload_factory(..., capacity=tuning.capacity_rps)`): the backend and the tuning hold this."""

    def __init__(self) -> None:
        self.factory: Callable[[int], list[W.WorkloadRequest]] | None = None

    def __call__(self, seed: int) -> list[W.WorkloadRequest]:
        if self.factory is None:
            raise RuntimeError("the workload is not set yet")
        return self.factory(seed)


class Narrated:
    """The live backend, saying what each replay cost as it goes (a vLLM start takes about a minute)."""

    name = "vllm"

    def __init__(self, backend: VllmBackend, base: VllmConfig, say: Say) -> None:
        self.backend, self.base, self.say = backend, base, say

    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        label, starts, t = _label(self.base, config), len(self.backend.launches), time.perf_counter()
        self.say(f"live: {label}, seed {seed} ...")
        try:
            m = self.backend.evaluate(config, run_id=run_id, seed=seed)
        except InfeasibleTrialError as exc:
            self.say(f"live: {label}, seed {seed}: infeasible: {exc.reason[:300]}")
            raise
        started = [x.ready_s for x in self.backend.launches[starts:] if x.ready_s is not None]
        start = f"vLLM started in {started[-1]:.0f} s, " if started else ""
        self.say(
            f"live: {label}, seed {seed}: {start}{time.perf_counter() - t:.0f} s in all; goodput "
            f"{m.goodput_tps:,.1f} tokens/s, p99 TTFT {_s(m.ttft_p99_s)}, {m.finished}/{m.requests} finished"
        )
        return m


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f} s"


@dataclass
class Outcome:
    decision: str
    changed: dict[str, Any]
    proposal: VllmProposal | None
    report_path: Path
    profile: dict[str, Any]
    restart: dict[str, Any]


@dataclass
class VllmTuning:
    """One screened tuning (module docstring); the phases fill in the fields they produce."""

    backend: VllmBackend
    db: Engine
    base: VllmConfig
    space: VllmSpace
    slo: SLO
    budget: Budget
    model: ModelConfig
    workload: Callable[[int], list[W.WorkloadRequest]]
    name: str
    steps_instances: Sequence[str] = ()
    steps_since: float | None = None
    min_steps: int = MIN_STEPS
    say: Say = lambda message: None
    progress: bool = False
    storage: Any = None  # the Optuna storage the screen's study is kept in (None: memory)
    t0: float = field(default_factory=time.time)
    baseline: LiveMeasurement | None = None
    profile: VllmProfile | None = None
    sim_backend: VllmSimBackend | None = None
    screened: ScreenResult | None = None
    heldout: dict[str, Any] | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget.validate()
        self.backend.pin(self.base)
        self.live = Narrated(self.backend, self.base, self.say)

    def _phase(self, key: str, since: float) -> None:
        self.phases[key] = round(time.time() - since, 1)

    def capacity_rps(self, opts: WL.WorkloadOptions) -> float:
        """The running config's requests/s on vLLM (a `workload_factory` capacity hook)."""
        t = time.time()
        self.say("the running config's capacity: the scenario mix all at once (the first vLLM start)")
        try:
            cap = self.backend.capacity_rps(self.base, WL.offline_mix(opts), run_id=f"{self.name}-capacity")
        except InfeasibleTrialError as exc:
            raise TuneError(f"the running config did not serve on vLLM: {exc.reason}") from exc
        self._phase("capacity_s", t)
        started = [x.ready_s for x in self.backend.launches if x.ready_s is not None]
        self.say(f"capacity {cap:.2f} req/s" + (f" (vLLM started in {started[-1]:.0f} s)" if started else ""))
        return cap

    def measure_baseline(self) -> LiveMeasurement:
        t = time.time()
        seeds = list(self.budget.tuning_seeds)
        self.say(f"the running config on tuning seed(s) {seeds}")
        params = self.space.from_config(self.base)
        m = live_measurement(self.live, self.base, params, seeds=seeds, slo=self.slo, name=f"{self.name}-running")
        if m.metrics is None:
            raise TuneError(f"the running config did not serve on vLLM: {m.infeasible}")
        if m.metrics["finished"] == 0:
            raise TuneError(
                f"vLLM answered but the database holds none of its requests: is the collector at "
                f"{self.backend.collector_url} writing to {self.db.url.render_as_string(hide_password=True)}, "
                "and is the ingest token right?"
            )
        self.baseline = m
        self._phase("baseline_s", t)
        return m

    def running_run_ids(self) -> list[str]:
        """The run ids the running config's replays were stored under (its server's, started or attached)."""
        ids = [e["run_id"] for e in self.backend.evaluations if e["config"] == self.base]
        ids += [x.run_id for x in self.backend.launches if x.config == self.base]
        return list(dict.fromkeys(ids))

    def calibrate(self) -> VllmProfile:
        t = time.time()
        since = self.t0 - 1.0 if self.steps_since is None else self.steps_since
        self.profile = calibrate_from_store(
            self.db,
            model=self.model,
            block_size=self.base.block_size,
            start=min(since, self.t0 - 1.0),
            end=time.time() + 60.0,
            run_ids=self.running_run_ids(),
            instances=self.steps_instances,
            min_steps=self.min_steps,
        )
        fit = self.profile.fit
        self.say(f"cost model from {self.profile.source['steps']} stored steps: R² {fit.r2}, MAPE {fit.mape}")
        self.sim_backend = VllmSimBackend(self.profile, self.workload, self.db, self.slo)
        self._phase("calibrate_s", t)
        return self.profile

    def screen(self) -> ScreenResult:
        if self.baseline is None or self.sim_backend is None:
            raise RuntimeError("screen: measure_baseline and calibrate first")
        t = time.time()
        b = self.budget
        self.say(f"screening {b.sim_trials} configs in the simulator, then the best {b.top_k} live (a restart each)")
        self.screened = screen(
            self.sim_backend,
            self.live,
            self.space,
            self.base,
            baseline=self.baseline,
            sim_trials=b.sim_trials,
            top_k=b.top_k,
            slo=self.slo,
            seeds=list(b.tuning_seeds),
            name=self.name,
            progress=self.progress,
            min_effect=b.min_effect,
            storage=self.storage,
        )
        sim_base = self.screened.sim.baseline
        self.baseline.sim_goodput = sim_base.goodput if sim_base else None
        best = self.screened.best
        self._phase("screen_s", t)
        self.say(
            f"screened {self.screened.sim_trials} in the simulator ({self.sim_backend.sim_seconds:.0f} s simulating); "
            f"best live: {_label(self.base, best.config)}, {best.goodput:,.1f} goodput tokens/s"
            + ("" if best.feasible else " (infeasible: no live config met the constraints)")
        )
        return self.screened

    def held_out(self, others: dict[str, VllmConfig] | None = None) -> dict[str, Any]:
        screened = self._screened()
        t = time.time()
        b = self.budget
        self.say(f"held-out seeds {list(b.heldout_seeds)} x {b.repeats}: the running config against the best")
        self.heldout = held_out(
            self.live,
            self.base,
            screened.best.config,
            seeds=list(b.heldout_seeds),
            slo=self.slo,
            name=self.name,
            repeats=b.repeats,
            others=others,
        )
        self._phase("heldout_s", t)
        self.say(f"held-out: gain {self.heldout['gain']:+.1%}, lower bound {self.heldout['gain_low']:+.1%}")
        return self.heldout

    def run(self) -> None:
        """Baseline, calibration, screen and (when the best is not the running config) the held-out check."""
        try:
            self.measure_baseline()
            self.calibrate()
            if changes(self.base, self.screen().best.config):
                self.held_out()
        finally:
            self.backend.close()

    def _screened(self) -> ScreenResult:
        if self.screened is None:
            raise RuntimeError("screen first")
        return self.screened

    def screened_rows(self) -> list[dict[str, Any]]:
        """The running config and each live confirmation: changes, simulated and live goodput, why infeasible."""
        screened = self._screened()
        return [
            {
                "changed": changes(self.base, m.config),
                "sim_goodput": m.sim_goodput,
                "live_goodput": m.goodput,
                "feasible": m.feasible,
                "infeasible": m.infeasible,
                "put_back": m.reverted,
                "pruning": m.pruning,  # per changed knob: the goodput its revert lost in the simulator, kept or not
            }
            for m in (screened.baseline, *screened.confirmed)
        ]

    def decision(self) -> tuple[str, bool]:
        h = self.heldout
        if not changes(self.base, self._screened().best.config):
            return "no proposal: the running config is the best the screened search found", False
        if h is None:
            raise RuntimeError("held_out first")
        if h["holds"]:
            return f"propose: {h['gain']:+.1%} goodput on held-out seeds (90% lower bound {h['gain_low']:+.1%})", True
        why = "" if h["best_feasible_all"] else "; the best was infeasible on a held-out run"
        return (
            f"no proposal: the gain did not hold on held-out seeds ({h['gain']:+.1%}, lower bound "
            f"{h['gain_low']:+.1%}{why})",
            False,
        )

    def profile_summary(self) -> dict[str, Any]:
        p = self.profile
        if p is None:
            return {}
        return {
            "steps": p.source["steps"],
            "r2": p.fit.r2,
            "mape": p.fit.mape,
            "overhead_ms": round(1000 * (p.overhead_s + 8 * p.overhead_per_seq_s), 2),
        }

    def finish(
        self,
        *,
        title: str,
        workload: dict[str, Any],
        out_dir: Path,
        instance: str | None,
        report_path: Path,
        live_only: dict[str, Any] | None = None,
    ) -> Outcome:
        """The decision, the report, and the proposal when the gain holds (else the report to `report_path`)."""
        screened = self._screened()
        decision, propose = self.decision()
        best = screened.best
        prof = self.profile_summary()
        restart = self.backend.restart_costs()
        report = render_report(
            title=title,
            decision=decision,
            workload=workload,
            slo=self.slo,
            base=self.base,
            screened=screened,
            heldout=self.heldout,
            restart=restart,
            profile=prof,
            live_only=live_only,
        )
        proposal = None
        h = self.heldout
        if propose and h is not None:
            proposal = publish(
                self.db,
                out_dir,
                name=self.name,
                instance=instance or self.backend.instance,
                base=self.base,
                best=best.config,
                report_md=report,
                baseline_metrics={"heldout": h["baseline"]},
                best_metrics={"heldout": h["best"], "confirmation": {"gain": h["gain"], "gain_low": h["gain_low"]}},
            )
            report_path = proposal.report_path
        else:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(report)
        return Outcome(decision, changes(self.base, best.config), proposal, report_path, prof, restart)


def preview(
    *,
    db: Engine,
    base: VllmConfig,
    space: VllmSpace,
    slo: SLO,
    profile: VllmProfile,
    workload: Callable[[int], list[W.WorkloadRequest]],
    sim_trials: int,
    top: int,
    seeds: Sequence[int],
    name: str,
    progress: bool = False,
    min_effect: float = 0.01,
    storage: Any = None,
) -> tuple[StudyResult, list[Candidate], float]:
    """The screen without vLLM: (the simulated study, the `top` configs `screen` would confirm live, pruned and
    best first, seconds simulating). With `storage` the simulated study is kept there (`simulate`)."""
    sim_backend = VllmSimBackend(profile, workload, db, slo)
    sim = simulate(
        sim_backend,
        space,
        base,
        sim_trials=sim_trials,
        slo=slo,
        seeds=list(seeds),
        name=name,
        progress=progress,
        storage=storage,
    )
    picked = candidates(sim_backend, space, base, sim, slo=slo, seeds=list(seeds), name=name, min_effect=min_effect)
    best = sorted(itertools.islice(picked, top), key=lambda c: -c.sim_goodput)  # pruned: their own order
    return sim, best, sim_backend.sim_seconds
