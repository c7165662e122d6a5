"""Where a trial runs: `sim` (the simulator, default), `engine` (in-process replay on the torch engine).
The `live` backend (a running engine through /admin/config) is in `tuner.live`; the `vllm` backend (a vLLM
restarted per trial) in `tuner.vllm.backend`.

Every backend measures the same way: the trial's events are stored in the kvpilot database under the
trial's run id and the metrics are read back with the collector's queries (`tuner.metrics`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy import Engine

from collector.db import memory_engine
from collector.queries import SIMULATED_INSTANCE_PREFIX
from engine import workload as W
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tuner.metrics import SLO, TrialMetrics, store_events, trial_metrics
from tuner.profile import CostProfile
from tuner.replay import Prepared, ReplayResult, SkipClock, TrialSink, prepared_workload, replay
from tuner.sim import sim_engine

log = logging.getLogger("kvpilot.tuner.backends")

WorkloadFactory = Callable[[int], list[W.WorkloadRequest]]


class InfeasibleTrialError(RuntimeError):
    """The config could not be measured because of itself: the engine refused it, crashed or ran out of memory
    on it. The study records an infeasible trial with this reason (never the end of the study)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotMeasuredError(RuntimeError):
    """The config could not be measured for a reason not its own (the replay client lagged behind its plan on
    every attempt, its process died): the trial is reported as not measured, with `reason`, never scored."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Backend(Protocol):
    name: str

    def evaluate(self, config: EngineConfig, *, run_id: str, seed: int) -> TrialMetrics: ...


def _telemetry(config: EngineConfig, run_id: str, instance: str) -> EngineConfig:
    data = config.model_dump(mode="json")
    data["telemetry"].update({"run_id": run_id, "instance": instance, "sink": "memory", "trace_alloc": True})
    return EngineConfig.from_dict(data, source="trial config")


class _Base:
    name = "base"

    def __init__(self, workload: WorkloadFactory, db: Engine | None, slo: SLO, *, instance: str) -> None:
        self.workload = workload
        self.db = db
        self.slo = slo.validate()
        self.instance = instance
        self._workloads: dict[int, Prepared] = {}
        self.last_replay: ReplayResult | None = None

    def requests(self, seed: int) -> Prepared:
        return prepared_workload(self._workloads, self.workload, seed)

    def _measure(self, sink: TrialSink, result: ReplayResult, run_id: str) -> TrialMetrics:
        """The trial's events through the collector's ingest, its metrics through the collector's queries. With
        no database (`db=None`) on a private in-memory one dropped right after: only the metrics are kept."""
        self.last_replay = result
        db = self.db if self.db is not None else memory_engine()
        try:
            store_events(db, sink.events, key_prefix=run_id)
            return trial_metrics(db, run_id=run_id, start=result.wall_start, end=result.wall_end + 1e-3, slo=self.slo)
        finally:
            if db is not self.db:
                db.dispose()


class SimulatedBackend(_Base):
    """A simulator as a backend: the workload replayed on an LLMEngine with a simulated executor and a virtual
    clock. Deterministic, so a config seen before on a seed is not re-simulated: its metrics are returned again
    (`cache_hits` counts them); with `jitter` each step's cost is drawn from the profile's spread (seeded by the
    workload seed) and every evaluation runs. A mode supplies `config_key` (what identifies a config) and
    `build_engine` (the engine for one trial), and may change the sink (`trial_sink`)."""

    def __init__(
        self,
        workload: WorkloadFactory,
        db: Engine | None,
        slo: SLO,
        *,
        instance: str,
        keep_steps: bool = False,
        jitter: bool = False,
    ) -> None:
        super().__init__(workload, db, slo, instance=instance)
        self.keep_steps, self.jitter = keep_steps, jitter
        self._cache: dict[tuple[str, int], TrialMetrics] = {}
        self.cache_hits = 0
        self.sim_seconds = 0.0
        self.last_busy_s = 0.0  # the simulated executor's busy time in the last replay

    def config_key(self, config: Any) -> str:
        raise NotImplementedError

    def build_engine(
        self, config: Any, *, run_id: str, sink: TrialSink, start_wall: float, jitter_seed: int | None
    ) -> LLMEngine:
        raise NotImplementedError

    def trial_sink(self) -> TrialSink:
        return TrialSink(keep_steps=self.keep_steps)

    def evaluate(self, config: Any, *, run_id: str, seed: int) -> TrialMetrics:
        key = (self.config_key(config), seed)
        if key in self._cache and not self.jitter:
            self.cache_hits += 1
            return self._cache[key]
        reqs, prompts = self.requests(seed)
        metrics = self._simulate(config, reqs, prompts, run_id=run_id, jitter_seed=seed if self.jitter else None)
        self._cache[key] = metrics
        return metrics

    def measure_requests(
        self, config: Any, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics:
        """`reqs` as given (e.g. time-compressed by `tuner.capacity`) on `config`, never cached."""
        return self._simulate(config, reqs, prompts, run_id=run_id, jitter_seed=None)

    def _simulate(
        self,
        config: Any,
        reqs: list[W.WorkloadRequest],
        prompts: list[list[int]],
        *,
        run_id: str,
        jitter_seed: int | None,
    ) -> TrialMetrics:
        sink = self.trial_sink()
        engine = self.build_engine(config, run_id=run_id, sink=sink, start_wall=time.time(), jitter_seed=jitter_seed)
        t = time.perf_counter()
        result = replay(engine, reqs, prompts=prompts)
        self.sim_seconds += time.perf_counter() - t
        self.last_busy_s = engine.executor.busy_s
        return self._measure(sink, result, run_id)


class SimBackend(SimulatedBackend):
    """The simulator on a cost profile (kvpilot's engine)."""

    name = "sim"

    def __init__(
        self,
        profile: CostProfile,
        workload: WorkloadFactory,
        db: Engine,
        slo: SLO,
        *,
        instance: str = f"{SIMULATED_INSTANCE_PREFIX}sim",
        keep_steps: bool = False,
    ) -> None:
        super().__init__(workload, db, slo, instance=instance, keep_steps=keep_steps)
        self.profile = profile

    def config_key(self, config: EngineConfig) -> str:
        return hashlib.sha256(self.profile.engine_config(config).to_yaml().encode()).hexdigest()

    def build_engine(
        self, config: EngineConfig, *, run_id: str, sink: TrialSink, start_wall: float, jitter_seed: int | None
    ) -> LLMEngine:
        engine, _ = sim_engine(
            _telemetry(config, run_id, self.instance),
            self.profile,
            sink=sink,
            start_wall=start_wall,
            jitter_seed=jitter_seed,
        )
        return engine


class EngineBackend(_Base):
    """In-process replay on the torch engine (real compute, idle gaps skipped). Warm-up requests run
    first (and are excluded from the metrics), as a freshly started server would."""

    name = "engine"

    def __init__(
        self,
        workload: WorkloadFactory,
        db: Engine,
        slo: SLO,
        *,
        instance: str = f"{SIMULATED_INSTANCE_PREFIX}engine",
        warmup: int = 4,
    ) -> None:
        super().__init__(workload, db, slo, instance=instance)
        self.warmup = warmup

    def evaluate(self, config: EngineConfig, *, run_id: str, seed: int) -> TrialMetrics:
        return self.measure_requests(config, *self.requests(seed), run_id=run_id)

    def measure_requests(
        self, config: EngineConfig, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics:
        """`reqs` as given (e.g. at a multiple of their rate, `tuner.capacity`) on a fresh engine of `config`."""
        sink = TrialSink(keep_steps=True)
        engine = LLMEngine(_telemetry(config, run_id, self.instance), clock=SkipClock(), sink=sink)
        engine.warmup(self.warmup)
        result = replay(engine, reqs, prompts=prompts)
        return self._measure(sink, result, run_id)
