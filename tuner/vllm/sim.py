"""The simulator in vLLM V1's mode: kvpilot's scheduler and KV cache manager configured as a vLLM is, on a cost
model fitted from that vLLM's own stored steps (`tuner.vllm.calibrate`).

What maps one to one (`engine_config`): `max_num_seqs` and `max_num_batched_tokens` (the sequence cap and the
token budget), `block_size` (fixed blocks, one page each, so a request holds ceil(tokens / block) blocks as in
vLLM's block pool), the KV pool (`kv_cache_memory_bytes` / bytes per token, no host tier), prefix caching (chained
hashes over full blocks, freed blocks stay cached until evicted LRU), recompute-only preemption of the latest
request, no admission watermark (vLLM's scheduler `watermark` defaults to 0), chunked prefill on or off
(`enable_chunked_prefill`) and the long-prefill threshold applied only while another request runs or waits
(`chunk_lone_prefill=False`), FCFS order (every request in one priority class), and no queue limit.

What it does not capture (docs/tuning.md, "Tuning a vLLM"): vLLM's frontend (HTTP, detokenization, the API process's
own CPU use on a shared machine) beyond the per-step overhead the profile measured; attention cost by position
(the iteration line has no per-request context, so the KV tokens held stand in for it); the priority policy's
preemption by priority (all replayed requests share one class); `max_num_partial_prefills` (not in vLLM 0.32);
a preempted request re-admitted at its arrival position rather than at the head of the queue; GPU memory sizing
by `gpu_memory_utilization`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from engine.clock import VirtualClock
from engine.config import BLOCK_SIZES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sinks import AnyEvent, EventSink
from integrations.vllm.config import VllmConfig, VllmConfigError
from tuner.backends import SimulatedBackend, WorkloadFactory
from tuner.metrics import SLO
from tuner.profile import StepShape
from tuner.replay import TrialSink
from tuner.sim import SimExecutor
from tuner.vllm.calibrate import VllmProfile

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


class VllmSimExecutor(SimExecutor):
    """Costs each step with the vLLM profile: the clock advances a whole cycle, busy time counts the forward."""

    profile: VllmProfile

    def cost(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[float, float]:
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
        return cycle, elapsed


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


class VllmSimBackend(SimulatedBackend):
    """The simulator as a study backend for `VllmConfig` trials (deterministic: a config is simulated once per
    seed; `jitter` draws each step's cost from the calibration's spread, for fidelity checks). With `db=None`
    nothing is stored: each trial is measured on a private in-memory database (`tuner.backends`)."""

    name = "vllm-sim"

    def __init__(
        self,
        profile: VllmProfile,
        workload: WorkloadFactory,
        db: Engine | None,
        slo: SLO,
        *,
        instance: str = "tuner-vllm-sim",
        jitter: bool = False,
        keep_steps: bool = False,
    ) -> None:
        super().__init__(workload, db, slo, instance=instance, keep_steps=keep_steps, jitter=jitter)
        self.profile = profile

    def config_key(self, config: VllmConfig) -> str:
        return hashlib.sha256(" ".join(config.to_args()).encode()).hexdigest()

    def trial_sink(self) -> TrialSink:
        return _VllmSink(keep_steps=self.keep_steps)

    def build_engine(
        self, config: VllmConfig, *, run_id: str, sink: TrialSink, start_wall: float, jitter_seed: int | None
    ) -> LLMEngine:
        engine, _ = sim_vllm_engine(
            config,
            self.profile,
            sink=sink,
            start_wall=start_wall,
            jitter_seed=jitter_seed,
            run_id=run_id,
            instance=self.instance,
        )
        return engine
