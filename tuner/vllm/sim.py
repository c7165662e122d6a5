"""The simulator in vLLM V1's mode: kvpilot's scheduler and KV cache manager configured as a vLLM is, on a cost
model fitted from that vLLM's own stored steps (`tuner.vllm.calibrate`).

What maps one to one (`engine_config`): `max_num_seqs` and `max_num_batched_tokens` (the sequence cap and the
token budget), `block_size` (fixed blocks, one page each, so a request holds ceil(tokens / block) blocks as in
vLLM's block pool), the KV pool (`kv_cache_memory_bytes` / bytes per token, no host tier), prefix caching (chained
hashes over full blocks, freed blocks stay cached until evicted LRU), recompute-only preemption of the latest
request, no admission watermark (vLLM's scheduler `watermark` defaults to 0), chunked prefill on or off
(`enable_chunked_prefill`) and the long-prefill threshold applied only while another request runs or waits
(`chunk_lone_prefill=False`), FCFS order (every request in one priority class), and no queue limit.

What it does not capture (README "Tuning a vLLM"): vLLM's frontend (HTTP, detokenization, the API process's
own CPU use on a shared machine) beyond the per-step overhead the profile measured; attention cost by position
(the iteration line has no per-request context, so the KV tokens held stand in for it); the priority policy's
preemption by priority (all replayed requests share one class); `max_num_partial_prefills` (not in vLLM 0.32);
a preempted request re-admitted at its arrival position rather than at the head of the queue; GPU memory sizing
by `gpu_memory_utilization`.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from engine import workload as W
from engine.clock import VirtualClock
from engine.config import BLOCK_SIZES, EngineConfig
from engine.executor import ExecuteResult
from engine.llm_engine import LLMEngine
from engine.sinks import AnyEvent, EventSink
from tuner.metrics import SLO, TrialMetrics, store_events, trial_metrics
from tuner.profile import StepShape
from tuner.replay import ReplayResult, TrialSink, prepare_prompts, replay
from tuner.vllm.calibrate import VllmProfile
from tuner.vllm.config import VllmConfig, VllmConfigError

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduler import SchedulerOutput

NO_QUEUE_LIMIT = 10_000_000


def engine_config(
    cfg: VllmConfig, profile: VllmProfile, *, instance: str = "tuner-vllm-sim", run_id: str | None = None
) -> EngineConfig:
    """The kvpilot EngineConfig that schedules as `cfg` makes vLLM schedule."""
    if cfg.block_size not in BLOCK_SIZES:
        raise VllmConfigError(
            f"block_size {cfg.block_size}: the simulator has blocks of {BLOCK_SIZES} only", "block_size"
        )
    if cfg.kv_cache_memory_bytes is None:
        raise VllmConfigError("the simulator sizes the KV pool from kv_cache_memory_bytes (no GPU memory model)")
    budget = cfg.max_num_batched_tokens
    threshold = cfg.long_prefill_token_threshold
    chunk = min(budget, threshold) if threshold > 0 else budget
    model = profile.model.config.model_dump(mode="json")
    model["max_position"] = cfg.max_model_len
    return EngineConfig.from_dict(
        {
            "device": "cpu",
            "model": model,
            "cache": {
                "page_tokens": cfg.block_size,
                "block_policy": "fixed",
                "block_size": cfg.block_size,
                "dynamic_sizes": [cfg.block_size] * 3,
                "hot_bytes": cfg.kv_cache_memory_bytes,
                "cold_bytes": 0,
                "enable_prefix_cache": cfg.enable_prefix_caching,
            },
            "scheduler": {
                "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": budget,
                "prefill_chunk_tokens": max(16, chunk),
                "preemption_mode": "recompute",
                "queue_limit": NO_QUEUE_LIMIT,
                "enable_chunked_prefill": cfg.enable_chunked_prefill,
                "chunk_lone_prefill": False,
            },
            "recycler": {"mode": "passive"},
            "warmup": {"requests": 0},
            "server": {"max_prompt_tokens": cfg.max_model_len, "max_tokens_limit": cfg.max_model_len},
            "telemetry": {"sink": "memory", "instance": instance, "run_id": run_id, "trace_alloc": True},
        },
        source="vLLM config in the simulator",
    )


class VllmSimExecutor:
    """Costs each step with the vLLM profile: the clock advances a whole cycle, busy time counts the forward."""

    device = "sim"

    def __init__(self, profile: VllmProfile, clock: VirtualClock, *, jitter_seed: int | None = None) -> None:
        self.profile = profile
        self.clock = clock
        self.model_cfg = profile.model.config
        self._rng = random.Random(jitter_seed) if jitter_seed is not None and profile.step_jitter else None
        self.page_tokens = 16
        self.steps = 0
        self.busy_s = 0.0

    @property
    def bytes_per_token(self) -> int:
        return self.profile.model.kv_bytes_per_token

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult:
        prefill_tokens = prefill_seqs = decode_seqs = 0
        for item in out.scheduled:
            if item.num_new_tokens == 1 and item.samples and item.seq.num_output_tokens > 0:
                decode_seqs += 1
            else:
                prefill_seqs += 1
                prefill_tokens += item.num_new_tokens
        held = (kv.hot.used_pages - kv.cached_pages) * kv.page_tokens
        shape = StepShape(
            prefill_tokens=prefill_tokens, prefill_seqs=prefill_seqs, decode_seqs=decode_seqs, decode_ctx_tokens=held
        )
        cycle, elapsed = self.profile.predict(shape, len(out.scheduled))
        if self._rng is not None:
            factor = self.profile.jitter(self._rng.random())
            cycle += elapsed * (factor - 1.0)
            elapsed *= factor
        self.clock.advance(cycle)
        self.steps += 1
        self.busy_s += elapsed
        tokens = [(len(item.seq.token_ids) % 250) + 1 if item.samples else None for item in out.scheduled]
        return ExecuteResult(tokens, elapsed)

    def release(self, seq_ids: Iterable[int]) -> None:
        return None


def sim_vllm_engine(
    cfg: VllmConfig,
    profile: VllmProfile,
    *,
    sink: EventSink | None = None,
    start_wall: float = 1_700_000_000.0,
    jitter_seed: int | None = None,
    run_id: str | None = None,
    instance: str = "tuner-vllm-sim",
) -> tuple[LLMEngine, VllmSimExecutor]:
    clock = VirtualClock(start_wall=start_wall)
    executor = VllmSimExecutor(profile, clock, jitter_seed=jitter_seed)
    engine_cfg = engine_config(cfg, profile, instance=instance, run_id=run_id)
    executor.model_cfg = engine_cfg.model  # max_position is vLLM's max_model_len: longer requests are refused
    engine = LLMEngine(engine_cfg, executor=executor, clock=clock, sink=sink)
    engine.kv.watermark_pages = 0  # vLLM admits while free blocks last
    return engine, executor


class _VllmSink(TrialSink):
    """What a real vLLM's telemetry gives the collector: request and step rows, no KV allocation trace (so no
    `oom` records either: vLLM preempts and recomputes as part of scheduling, and neither side counts it as OOM)."""

    def emit(self, event: AnyEvent) -> None:
        if event.type == "alloc":
            self.dropped += 1
            return
        super().emit(event)


class VllmSimBackend:
    """The simulator as a study backend for `VllmConfig` trials (deterministic: a config is simulated once per
    seed; `jitter` draws each step's cost from the calibration's spread, for fidelity checks)."""

    name = "vllm-sim"

    def __init__(
        self,
        profile: VllmProfile,
        workload: Callable[[int], list[W.WorkloadRequest]],
        db: Engine,
        slo: SLO,
        *,
        instance: str = "tuner-vllm-sim",
        jitter: bool = False,
        keep_steps: bool = False,
    ) -> None:
        self.profile, self.workload, self.db, self.slo = profile, workload, db, slo.validate()
        self.instance, self.jitter, self.keep_steps = instance, jitter, keep_steps
        self._workloads: dict[int, tuple[list[W.WorkloadRequest], list[list[int]]]] = {}
        self._cache: dict[tuple[str, int], TrialMetrics] = {}
        self.cache_hits = 0
        self.sim_seconds = 0.0
        self.last_replay: ReplayResult | None = None
        self.last_busy_s = 0.0

    def requests(self, seed: int) -> tuple[list[W.WorkloadRequest], list[list[int]]]:
        if seed not in self._workloads:
            reqs = self.workload(seed)
            self._workloads[seed] = (reqs, prepare_prompts(reqs, seed))
        return self._workloads[seed]

    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        key = (hashlib.sha256(" ".join(config.to_args()).encode()).hexdigest(), seed)
        if key in self._cache and not self.jitter:
            self.cache_hits += 1
            return self._cache[key]
        reqs, prompts = self.requests(seed)
        sink = _VllmSink(keep_steps=self.keep_steps)
        engine, executor = sim_vllm_engine(
            config,
            self.profile,
            sink=sink,
            start_wall=time.time(),
            jitter_seed=seed if self.jitter else None,
            run_id=run_id,
            instance=self.instance,
        )
        t = time.perf_counter()
        result = replay(engine, reqs, seed=seed, prompts=prompts)
        self.sim_seconds += time.perf_counter() - t
        self.last_replay, self.last_busy_s = result, executor.busy_s
        store_events(self.db, sink.events, key_prefix=run_id)
        metrics = trial_metrics(
            self.db, run_id=run_id, start=result.wall_start, end=result.wall_end + 1e-3, slo=self.slo
        )
        self._cache[key] = metrics
        return metrics


def capacity_rps(cfg: VllmConfig, profile: VllmProfile, offline: list[W.WorkloadRequest]) -> float:
    """Requests/s `cfg` sustains in the simulator on an offline batch (`tuner.workloads.offline_mix`), as
    `tuner.jobs.capacity_rps` measures a kvpilot config's capacity."""
    engine, _ = sim_vllm_engine(cfg, profile, sink=_VllmSink(keep_steps=False))
    result = replay(engine, offline)
    if not result.finished or result.duration_s <= 0:
        raise ValueError("capacity: the capacity run finished no request")
    return len(result.finished) / result.duration_s
