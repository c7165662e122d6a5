"""One screened tuning of a vLLM, from the config it runs to a proposal: what `kvpilot tune vllm study` runs and
`kvpilot bench tune-vllm` measures (the bench adds its live-only search to `confirm` and its A/A check to
`finish`).

The objective is SLO capacity (`tuner.capacity`): how many times the workload's arrival rate a config serves
within its SLOs. Memory is a budget: the space holds the KV cache at the running config's size unless
`allow_memory` (then a proposal's extra memory is its own line, with the best at fixed memory beside it).

`VllmTuning` is the vLLM target of the one tuning pipeline (`tuner.pipeline`: the order, the gain rule, the
decision's words and the headroom line are the pipeline's), on one `VllmBackend`, the running config's server
pinned (kept up):
- `capacity_rps` (before the pipeline, for a scenario workload): the anchor config's requests/s, live (the
  scenario mix all at once), which sets the traffic's rate;
- `baseline`: the running config live on the tuning seeds at the recorded rate (`measure_baseline`), then its
  SLO capacity on the first tuning seed (`baseline_capacity`: a bracketing search on its server);
- `screen`: the simulator's cost model from the steps the collector stored for those replays, and for
  `steps_instances` (e.g. the operator's own vLLM) since `steps_since` (`calibrate`); then `sim_trials` configs
  in the simulator past the running config's simulated capacity, where configs differ in what they serve within
  the SLOs, and the `top_k` best confirmed live (`screen_configs`, `tuner.vllm.screen`);
- `confirm`: the predicted (simulated) and live capacity of the running config and each confirmation
  (`confirm_capacities`); the candidate is the confirmation with the most live capacity, compared on the held-out
  seeds even where its one search measured under the running config's (a single search is as noisy as half an
  ABBA pair, and the paired comparison is built for that noise), unless the simulator put it below the running
  config or it lost by more than `CONFIRM_LOSS`; the screen's ranking is scored (`rank_correlation`);
- `held_out`: the running config against the candidate on new seeds, both servers up, the idle one paused,
  ABBA pairs until the 90% interval of the capacity ratio says (`tuner.compare`); `aa_check` is the same
  protocol with the running config on both servers;
- `finish`: the markdown report, and a proposal (vLLM `--config` file, report, row) only when the pipeline's
  verdict says so (the comparison's is `proposal`: the whole interval above 1).

`preview` is the screen without vLLM: the simulator calibrated from what the collector already stores, and the
best configs it finds with their predicted goodput, so an operator can look before paying for restarts.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine

from collector.queries import StoredStep, stored_steps
from engine import workload as W
from engine.config import ModelConfig
from integrations.vllm.config import VllmConfig, VllmConfigError
from tuner import pipeline
from tuner import workloads as WL
from tuner.backends import InfeasibleTrialError
from tuner.capacity import MIN_MULTIPLIER, Capacity, at_rate_requests, replay_capacity, replay_capacity_near
from tuner.compare import DEFAULT_MARGIN, MAX_PAIRS, Comparison, ReplayerSide, compare_arms, rotation
from tuner.metrics import SLO, TrialMetrics
from tuner.pipeline import Choice, Verdict
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
    live_measurement,
    screen,
    simulate,
)
from tuner.vllm.sim import VllmSimBackend, sim_vllm_engine
from tuner.vllm.space import VllmSpace, at_fixed_memory, memory_changes

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
MAX_REPLAYS = 12  # per capacity search
SCREEN_OVERLOAD = 1.25  # the screen replays at this multiple of the running config's simulated capacity
# A confirmation whose one capacity search measured this much under the running config's is not compared on the
# held-out seeds: one search's noise (about 3% sd in the A/A pairs) cannot move it that far. Within it the
# comparison decides: run 13's candidate measured -8% in its search and +8.3% over 2 ABBA pairs in run 12.
CONFIRM_LOSS = 0.2


def _aa_arm(base: VllmConfig) -> tuple[str, VllmConfig, str]:
    """The A/A check's arm: a second server of the running config, in slot `aa`."""
    return ("aa", base, "aa")


T = TypeVar("T")


def launch_order(sides: Sequence[T], i: int) -> list[T]:
    """The order round `i` starts its fresh servers in: rotated by one each round, so every side is started first,
    second, ... equally often. Started together, servers of one config are not alike by their order: in `bench
    vllm-placement` the second-started of two servers left where the kernel put them measured faster in all 8
    rounds (log ratio +0.019 to +0.114), which a fixed order would put into every pair as the candidate's gain."""
    return rotation(sides, i) if sides else []


@dataclass(frozen=True)
class Budget:
    tuning_seeds: tuple[int, ...] = (0,)
    sim_trials: int = 200
    top_k: int = 2
    heldout_seeds: tuple[int, ...] = (1000, 1001, 1002)
    repeats: int = 1  # the held-out seeds are cycled this many times: at most seeds x repeats ABBA pairs
    min_effect: float = 0.01  # a simulated change stays only if its revert costs this much goodput (the pruning)
    capacity_replays: int = 7  # a full capacity search (the running config's, each confirmation's)
    pair_replays: int = 4  # one measurement of the comparison (warm-started, it stops at its first bracket)
    min_pairs: int = 2
    margin: float = DEFAULT_MARGIN  # capacity ratios within 1 +- margin are "no gain": not worth a restart
    fresh_servers: bool = True  # every held-out round on fresh servers (`tuner.compare`: instances randomized)

    @property
    def max_pairs(self) -> int:
        return len(self.heldout_seeds) * self.repeats

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
        for name, value in (("capacity_replays", self.capacity_replays), ("pair_replays", self.pair_replays)):
            if not 2 <= value <= MAX_REPLAYS:
                raise ValueError(f"{name}: must be within 2..{MAX_REPLAYS}, got {value}")
        if not 0 <= self.margin < 0.5:
            raise ValueError(f"margin: must be within [0, 0.5), got {self.margin}")
        if not 2 <= self.min_pairs <= self.max_pairs:
            raise ValueError(
                f"heldout_seeds: the comparison needs at least {max(2, self.min_pairs)} ABBA pairs, one per "
                f"held-out seed and repeat; {len(self.heldout_seeds)} seed(s) x {self.repeats} can never say more "
                "than inconclusive"
            )
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


@dataclass(frozen=True)
class ReportTo:
    """Where and how `VllmTuning.finish` writes: the report's title, the workload's description, the proposal's
    directory and instance, and the report's path when there is no proposal."""

    title: str
    workload: dict[str, Any]
    out_dir: Path
    report_path: Path
    instance: str | None = None


@dataclass
class Outcome:
    verdict: Verdict  # the pipeline's (`tuner.pipeline`): the decision, the running capacity, phase times
    changed: dict[str, Any]
    proposal: VllmProposal | None
    report_path: Path
    profile: dict[str, Any]
    restart: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # headroom, extra memory

    @property
    def decision(self) -> str:
        return self.verdict.decision


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
    allow_memory: bool = False  # search the KV cache's size too (else held at the running config's)
    report_to: ReportTo | None = None  # what `finish` writes (set before `run`)
    live_only: dict[str, Any] | None = None  # a live-only search's figures for the report (the bench's)
    t0: float = field(default_factory=time.time)
    baseline_live: LiveMeasurement | None = None  # the running config at the recorded rate
    running_capacity: Capacity | None = None
    sim_running: Capacity | None = None  # the running config's simulated capacity
    profile: VllmProfile | None = None
    sim_backend: VllmSimBackend | None = None
    screened: ScreenResult | None = None
    confirmed: list[dict[str, Any]] = field(default_factory=list)  # `confirm`'s rows, the running config first
    candidate: VllmConfig | None = None
    heldout: Comparison | None = None
    aa: Comparison | None = None
    phases: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget.validate()
        if not self.allow_memory:
            self.space = at_fixed_memory(self.space, self.base)
        self.backend.pin(self.base)
        self.live = Narrated(self.backend, self.base, self.say)

    def _phase(self, key: str, since: float) -> None:
        self.phases[key] = round(time.time() - since, 1)

    def capacity_rps(self, opts: WL.WorkloadOptions, *, anchor: VllmConfig | None = None) -> float:
        """The offline requests/s on vLLM of `anchor` (default: the running config), the scenario's rate anchor
        (a `workload_factory` capacity hook); not an SLO capacity (`baseline_capacity`). A traffic is what
        users send, not what the running config can take: a bench that starts from a deliberately poor config
        anchors its traffic on vLLM's defaults, as the plain run's."""
        t = time.time()
        config = anchor or self.base
        which = "the running config's" if config == self.base else f"{_label(self.base, config)}:"
        self.say(f"{which} offline throughput: the scenario mix all at once (the first vLLM start)")
        try:
            cap = self.backend.capacity_rps(config, WL.offline_mix(opts), run_id=f"{self.name}-capacity")
        except InfeasibleTrialError as exc:
            raise TuneError(f"the traffic's anchor config did not serve on vLLM: {exc.reason}") from exc
        self._phase("capacity_s", t)
        started = [x.ready_s for x in self.backend.launches if x.ready_s is not None]
        self.say(f"offline {cap:.2f} req/s" + (f" (vLLM started in {started[-1]:.0f} s)" if started else ""))
        return cap

    def measure_baseline(self) -> LiveMeasurement:
        t = time.time()
        seeds = list(self.budget.tuning_seeds)
        self.say(f"the running config on tuning seed(s) {seeds}")
        params = self.space.from_config(self.base)
        m = live_measurement(self.live, self.base, params, seeds=seeds, slo=self.slo, name=f"{self.name}-running")
        if m.metrics is None:
            raise TuneError(f"the running config was not measured on vLLM: {m.infeasible}")
        if m.metrics["finished"] == 0:
            raise TuneError(
                f"vLLM answered but the database holds none of its requests: is the collector at "
                f"{self.backend.collector_url} writing to {self.db.url.render_as_string(hide_password=True)}, "
                "and is the ingest token right?"
            )
        self.baseline_live = m
        self._phase("baseline_s", t)
        return m

    def live_capacity(self, config: VllmConfig, *, seed: int, start: float, label: str) -> Capacity:
        """`config`'s capacity on its live server for the workload of `seed` (a full search from `start`)."""
        reqs, prompts = self.backend.requests(seed)
        t = time.perf_counter()
        cap = replay_capacity(
            self.backend,
            config,
            reqs,
            prompts,
            slo=self.slo,
            run_id=f"{self.name}-capacity-{label}",
            start=start,
            max_replays=self.budget.capacity_replays,
        )
        self._said_capacity(config, cap, time.perf_counter() - t)
        return cap

    def capacity_near_running(self, config: VllmConfig, *, label: str) -> Capacity:
        """`config`'s capacity on the first tuning seed, searched from the running config's (`tuner.capacity.near`:
        2 replays when it is within a step of it, a wide search only when not), as the comparison measures."""
        reqs, prompts = self.backend.requests(self.budget.tuning_seeds[0])
        t = time.perf_counter()
        cap = replay_capacity_near(
            self.backend,
            config,
            reqs,
            prompts,
            slo=self.slo,
            run_id=f"{self.name}-capacity-{label}",
            start=self._start_multiplier(),
            max_replays=self.budget.pair_replays,
            wide_replays=self.budget.capacity_replays,
        )
        self._said_capacity(config, cap, time.perf_counter() - t)
        return cap

    def _said_capacity(self, config: VllmConfig, cap: Capacity, took: float) -> None:
        self.say(
            f"capacity of {_label(self.base, config)}: {cap.capacity_rps:.2f} req/s (x{cap.multiplier:.2f} the "
            f"workload's {cap.rate_rps:.2f} req/s; {len(cap.probes)} replays, {took:.0f} s)"
            + (f"; at least that: the search stopped at {cap.not_measured}" if cap.not_measured else "")
        )

    def baseline_capacity(self) -> Capacity:
        """The running config's SLO capacity on the first tuning seed, on its pinned server."""
        t = time.time()
        try:
            self.running_capacity = self.live_capacity(
                self.base, seed=self.budget.tuning_seeds[0], start=1.0, label="running"
            )
        except InfeasibleTrialError as exc:
            raise TuneError(f"the running config did not serve on vLLM: {exc.reason}") from exc
        self._phase("baseline_capacity_s", t)
        return self.running_capacity

    def baseline(self) -> Capacity:
        """The pipeline's first phase: the running config live on the tuning seeds at the recorded rate (what
        calibrates the simulator), then its SLO capacity."""
        self.measure_baseline()
        return self.baseline_capacity()

    def _start_multiplier(self) -> float:
        return self.running_capacity.warm_start if self.running_capacity is not None else 1.0

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
        # the simulated trials keep their metrics in memory: nothing simulated lands in the collector's database
        plain = VllmSimBackend(self.profile, self.workload, None, self.slo)
        self.sim_running = self.sim_capacity(plain, self.base)
        overload = SCREEN_OVERLOAD * max(self.sim_running.multiplier, MIN_MULTIPLIER)
        self.sim_backend = VllmSimBackend(
            self.profile, lambda seed: at_rate_requests(self.workload(seed), overload), None, self.slo
        )
        self.say(
            f"simulated capacity of the running config: x{self.sim_running.multiplier:.2f}; the screen replays "
            f"at x{overload:.2f} (past it, where configs differ in what they serve within the SLOs)"
        )
        self._phase("calibrate_s", t)
        return self.profile

    def sim_capacity(self, sim: VllmSimBackend, config: VllmConfig) -> Capacity:
        """`config`'s capacity in the simulator on the first tuning seed (what the screen predicts)."""
        reqs, prompts = self.backend.requests(self.budget.tuning_seeds[0])
        return replay_capacity(
            sim, config, reqs, prompts, slo=self.slo, run_id=f"{self.name}-simcap", start=self._start_multiplier()
        )

    def screen(self) -> None:
        """The pipeline's search: the simulator calibrated from the stored steps, then the screened study."""
        self.calibrate()
        self.screen_configs()

    def screen_configs(self) -> ScreenResult:
        if self.baseline_live is None or self.sim_backend is None:
            raise RuntimeError("screen: measure_baseline and calibrate first")
        t = time.time()
        b = self.budget
        self.say(f"screening {b.sim_trials} configs in the simulator, then the best {b.top_k} live (a restart each)")
        self.screened = screen(
            self.sim_backend,
            self.live,
            self.space,
            self.base,
            baseline=self.baseline_live,
            sim_trials=b.sim_trials,
            top_k=b.top_k,
            slo=self.slo,
            seeds=list(b.tuning_seeds),
            name=self.name,
            progress=self.progress,
            min_effect=b.min_effect,
            storage=self.storage,
            sim_slo=self.slo.past_capacity(),  # the simulated replays run past the running config's capacity
        )
        sim_base = self.screened.sim.baseline
        self.baseline_live.sim_goodput = sim_base.goodput if sim_base else None
        best = self.screened.best
        self._phase("screen_s", t)
        self.say(
            f"screened {self.screened.sim_trials} in the simulator ({self.sim_backend.sim_seconds:.0f} s simulating); "
            f"best live: {_label(self.base, best.config)}, {best.goodput:,.1f} goodput tokens/s"
            + ("" if best.feasible else " (infeasible: no live config met the constraints)")
        )
        return self.screened

    def confirm(self) -> Choice:
        """The pipeline's choice (`choose` over `confirm_capacities`' rows)."""
        rows = self.confirm_capacities()
        choice = choose(self.base, rows)
        self.candidate = choice.candidate
        if choice.candidate is not None:
            live = next(r["live_capacity_rps"] for r in rows if r["config"] == choice.candidate)
            theirs = rows[0]["live_capacity_rps"]
            if live <= theirs:
                self.say(
                    f"confirmation: {_label(self.base, choice.candidate)} measured {live:.2f} req/s against the "
                    f"running config's {theirs:.2f}, one search each; the held-out comparison decides"
                )
        return choice

    def confirm_capacities(self) -> list[dict[str, Any]]:
        """Predicted and live capacity of the running config and of each live-feasible confirmation, the running
        config's row first. The confirmations still up are measured first (no restart)."""
        screened = self._screened()
        if self.running_capacity is None or self.sim_backend is None:
            raise RuntimeError("confirm: baseline_capacity and calibrate first")
        t = time.time()
        rows = [self._capacity_row(self.base, self.running_capacity)]
        for m in reversed([m for m in screened.confirmed if m.metrics is not None]):
            try:
                cap = self.capacity_near_running(m.config, label="confirm")
            except InfeasibleTrialError as exc:
                self.say(f"capacity of {_label(self.base, m.config)}: infeasible: {exc.reason[:300]}")
                continue
            rows.append(self._capacity_row(m.config, cap))
        self.confirmed = rows
        self._phase("confirm_s", t)
        return rows

    def _capacity_row(self, config: VllmConfig, cap: Capacity) -> dict[str, Any]:
        assert self.sim_backend is not None
        predicted = self.sim_running if config == self.base else self.sim_capacity(self.sim_backend, config)
        return {
            "config": config,
            "changed": changes(self.base, config),
            # each search's estimate within its bracket: lower ends alone tie configs a step apart (`tuner.capacity`)
            "predicted_capacity_rps": predicted.estimate_rps,
            "live_capacity_rps": cap.estimate_rps,
            "live": cap.summary(),
        }

    def rank_correlation(self) -> float | None:
        """Spearman's rank correlation of predicted against live capacity over the confirmed configs."""
        rows = self.confirmed
        return spearman([r["predicted_capacity_rps"] for r in rows], [r["live_capacity_rps"] for r in rows])

    def _side(self, label: str, config: VllmConfig, slot: str) -> ReplayerSide:
        b = self.budget
        return ReplayerSide(
            label=label,
            backend=_InSlot(self.backend, slot),
            config=config,
            requests=self.backend.requests,
            slo=self.slo,
            name=self.name,
            max_replays=b.pair_replays,
            scout_replays=b.capacity_replays,
            on_pause=lambda: self.backend.pause(config, slot),
            on_resume=lambda: self.backend.resume(config, slot),
        )

    def _compare(self, arms: list[tuple[str, VllmConfig, str]], what: str) -> list[Comparison]:
        """The running config against each arm (label, config, slot) in shared rounds (`compare_arms`), every
        server up (pinned for the comparison) and the idle ones paused. With `fresh_servers` every round starts
        on fresh servers of every side, the running config's included (on a server of ours, in slot `fresh`,
        when its own is attached: the operator's cannot be restarted)."""
        b = self.budget
        pairs = min(b.max_pairs, MAX_PAIRS)
        fresh = " (fresh servers each round)" if b.fresh_servers else ""
        self.say(f"{what}: ABBA pairs on held-out seeds {list(b.heldout_seeds)}, {b.min_pairs}..{pairs} pairs{fresh}")
        running_slot = "fresh" if b.fresh_servers and self.backend.is_attached(self.base) else ""
        sides = [("running", self.base, running_slot), *arms]
        for _, config, slot in sides:
            self.backend.pin(config, slot)
        if not b.fresh_servers:
            for _, config, slot in arms:
                self.backend.start(config, run_id=f"{self.name}-{slot or 'candidate'}", slot=slot)

        def renew(i: int, labels: list[str]) -> None:
            t = time.time()
            measured = [side for side in sides if side[0] in labels]
            for label, config, slot in sides:
                if label not in labels:  # an arm that has said: its server goes with the round's renewal
                    self.backend.unpin(config, slot)
            try:
                order = launch_order(measured, i)
                self.backend.renew([(config, slot, f"{self.name}-{label}-r{i + 1}") for label, config, slot in order])
            except InfeasibleTrialError as exc:  # a config that served before: the machine's, not the config's
                raise TuneError(f"held-out round {i + 1}: a fresh server did not start: {exc.reason}") from exc
            took = time.time() - t
            self.phases["renew_s"] = round(self.phases.get("renew_s", 0.0) + took, 1)
            self.say(f"round {i + 1}: {len(measured)} fresh servers up and warmed in {took:.0f} s")

        running = self.running_capacity
        try:
            return compare_arms(
                self._side("running", self.base, running_slot),
                [self._side(label, config, slot) for label, config, slot in arms],
                seeds=list(b.heldout_seeds),
                start=self._start_multiplier(),
                min_pairs=b.min_pairs,
                max_pairs=pairs,
                margin=b.margin,
                floor_rps=MIN_MULTIPLIER * (running.rate_rps if running else 1.0),
                renew=renew if b.fresh_servers else None,
                say=self.say,
            )
        finally:
            for _, config, slot in arms:
                self.backend.unpin(config, slot)
            if running_slot:
                self.backend.unpin(self.base, running_slot)

    def held_out(self, candidate: VllmConfig) -> Comparison:
        """The running config against the candidate (`tuner.compare`), both servers up."""
        t = time.time()
        (self.heldout,) = self._compare(
            [("candidate", candidate, "")], "held-out: the running config against the candidate"
        )
        self._phase("heldout_s", t)
        self.say(f"held-out: {self.heldout.sentence()}")
        return self.heldout

    def aa_check(self) -> Comparison:
        """The same protocol with the running config on both servers (a second one in slot `aa`): it must not say
        `proposal`; what it says is the comparison's own false-alarm check on this machine."""
        t = time.time()
        (self.aa,) = self._compare([_aa_arm(self.base)], "A/A check: the running config against itself")
        self._phase("aa_s", t)
        self.say(f"A/A check: {self.aa.verdict} ({self.aa.sentence()})")
        return self.aa

    def held_out_with_aa(self, candidate: VllmConfig) -> tuple[Comparison, Comparison]:
        """The held-out comparison and the A/A check in shared rounds (A B A' A' B A: `compare_arms`), three
        servers up: 6 measurements a round where the two one after the other take 8."""
        t = time.time()
        self.heldout, self.aa = self._compare(
            [("candidate", candidate, ""), _aa_arm(self.base)],
            "held-out and A/A check: the running config against the candidate and against itself",
        )
        self._phase("heldout_aa_s", t)
        self.say(f"held-out: {self.heldout.sentence()}")
        self.say(f"A/A check: {self.aa.verdict} ({self.aa.sentence()})")
        return self.heldout, self.aa

    def run(self) -> Outcome:
        """The whole tuning (`tuner.pipeline`): baseline, screen, confirmation, the held-out comparison when the
        candidate is not the running config, the decision, the report and (when it says so) the proposal. The
        servers are stopped however it ends."""
        try:
            return pipeline.run(self)
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

    def memory_line(self) -> str | None:
        """A candidate's extra memory (only with `allow_memory`), and the best at fixed memory beside it."""
        if self.candidate is None or not memory_changes(self.base, self.candidate):
            return None
        extra = ", ".join(
            f"--{k.replace('_', '-')} {_mem(a)} -> {_mem(b)}"
            for k, (a, b) in memory_changes(self.base, self.candidate).items()
        )
        fixed = [r for r in self.confirmed if not memory_changes(self.base, r["config"])]
        best = max(fixed, key=lambda r: r["live_capacity_rps"])
        running = self.confirmed[0]["live_capacity_rps"]
        gain = best["live_capacity_rps"] / running - 1.0 if running > 0 else 0.0
        return (
            f"extra memory: {extra}; without it the best is {_label(self.base, best['config'])} at "
            f"{best['live_capacity_rps']:.2f} req/s ({gain:+.1%} over the running config, one search each)"
        )

    def heldout_summary(self) -> dict[str, Any] | None:
        return None if self.heldout is None else self.heldout.as_dict()

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

    def finish(self, verdict: Verdict) -> Outcome:
        """The report, and the proposal when the verdict says so (else the report to `report_to.report_path`).
        Every measurement is done by then: the servers are stopped first (their stop times join the restart
        costs)."""
        if self.report_to is None:
            raise RuntimeError("finish: set report_to first")
        to = self.report_to
        self.backend.close()
        screened = self._screened()
        best = verdict.candidate or self.base
        prof = self.profile_summary()
        restart = self.backend.restart_costs()
        notes = [*verdict.notes, *[line for line in (self.memory_line(),) if line]]
        report = render_report(
            title=to.title,
            decision=verdict.decision,
            workload=to.workload,
            slo=self.slo,
            base=self.base,
            best=best,
            screened=screened,
            capacities=self.confirmed,
            heldout=self.heldout,
            aa=self.aa,
            notes=notes,
            restart=restart,
            profile=prof,
            live_only=self.live_only,
        )
        proposal = None
        h = verdict.comparison
        report_path = to.report_path
        if verdict.propose and h is not None:
            proposal = publish(
                self.db,
                to.out_dir,
                name=self.name,
                instance=to.instance or self.backend.instance,
                base=self.base,
                best=best,
                report_md=report,
                baseline_metrics={
                    "capacity": verdict.running.summary(),
                    "heldout_capacity_rps": h.mean_capacity("running"),
                },
                best_metrics={"heldout_capacity_rps": h.mean_capacity("candidate"), "confirmation": h.as_dict()},
            )
            report_path = proposal.report_path
        else:
            report_path.parent.mkdir(parents=True, exist_ok=True)
            report_path.write_text(report)
        return Outcome(verdict, changes(self.base, best), proposal, report_path, prof, restart, notes)


class _InSlot:
    """The vLLM backend replaying on the server in one slot (a `tuner.capacity.Replayer`)."""

    def __init__(self, backend: VllmBackend, slot: str) -> None:
        self.backend, self.slot = backend, slot

    def measure_requests(
        self, config: VllmConfig, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics:
        return self.backend.measure_requests(config, reqs, prompts, run_id=run_id, slot=self.slot)


def choose(base: VllmConfig, rows: Sequence[dict[str, Any]]) -> Choice:
    """The candidate among confirmation rows (`VllmTuning.confirm_capacities`: the running config's first): the
    confirmation with the most live capacity, sent to the held-out comparison whatever its one search said against
    the running config's, unless the simulator put it at or below the running config or its search lost by more
    than `CONFIRM_LOSS`; every confirmation is a rival for the headroom line."""
    rivals = tuple((_label(base, r["config"]), r["live_capacity_rps"]) for r in rows[1:])
    running = rows[0]
    if len(rows) == 1:
        return Choice(None, "no screened config was feasible live", rivals)
    tried = [r for r in rows[1:] if r["predicted_capacity_rps"] > running["predicted_capacity_rps"]]
    if not tried:
        return Choice(None, "the simulator found no config with more capacity than the running one", rivals)
    best = max(tried, key=lambda r: r["live_capacity_rps"])
    live, theirs = best["live_capacity_rps"], running["live_capacity_rps"]
    if live < (1.0 - CONFIRM_LOSS) * theirs:
        why = (
            f"the screened best measured {live:.2f} req/s against the running config's {theirs:.2f}, more than "
            f"{CONFIRM_LOSS:.0%} below: not worth a held-out comparison"
        )
        return Choice(None, why, rivals)
    return Choice(best["config"], rivals=rivals)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties get their mean rank); None for fewer than 2 pairs or a constant side."""
    if len(xs) != len(ys) or len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / (sxx * syy) ** 0.5


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _mem(value: Any) -> str:
    return f"{value / 2**20:g} MiB" if isinstance(value, int) and value >= 2**20 else str(value)


def preview(
    *,
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
    allow_memory: bool = False,
) -> tuple[StudyResult, list[Candidate], float]:
    """The screen without vLLM: (the simulated study, the `top` configs `screen` would confirm live, pruned and
    best first, seconds simulating). With `storage` the simulated study is kept there (`simulate`); nothing is
    written to the collector's database. The KV cache's size is held at `base`'s unless `allow_memory`."""
    if not allow_memory:
        space = at_fixed_memory(space, base)
    sim_backend = VllmSimBackend(profile, workload, None, slo)
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
