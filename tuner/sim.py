"""The simulator: the engine's own scheduler, KV cache manager, recycler and telemetry, with an
executor that predicts each step's cost from a profile and advances a virtual clock instead of
running a model (docs/architecture.md, "Engine inside"). Same code, another executor.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.executor import ExecuteResult, group_decode_rows
from engine.llm_engine import LLMEngine
from engine.sinks import EventSink
from engine.stats import StatLogger
from tuner.profile import CostProfile, StepShape

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduler import SchedulerOutput

EOS_TOKEN = 257  # the byte tokenizer's; the simulator never samples it


def step_shape(out: SchedulerOutput, kv: KVCacheManager, page_tokens: int) -> StepShape:
    """The cost-model features of a scheduled step (also used when calibrating on the real engine)."""
    prefill_tokens = prefill_seqs = decode_seqs = 0
    decode_ctx = decode_slots = decode_blocks = attn_pairs = prefill_ctx = 0
    lens: list[int] = []
    for item in out.scheduled:
        n, start = item.num_new_tokens, item.start
        if n == 1 and item.samples and item.seq.num_output_tokens > 0 and not prefill_seqs:
            decode_seqs += 1
            decode_ctx += start + 1
            lens.append(start + 1)
            sizes = kv.block_sizes(item.seq.seq_id)
            decode_blocks += len(sizes)
            decode_slots += sum(sizes)
        else:
            prefill_seqs += 1
            prefill_tokens += n
            attn_pairs += n * start + n * (n + 1) // 2
            prefill_ctx += start + n
    swap_pages = sum(p.num_pages for p in out.swap_out) + sum(p.num_pages for p in out.swap_in)
    attn_tokens, groups = decode_attention(lens, page_tokens)
    return StepShape(
        prefill_tokens=prefill_tokens,
        prefill_seqs=prefill_seqs,
        decode_seqs=decode_seqs,
        decode_ctx_tokens=decode_ctx,
        decode_kv_slots=decode_slots,
        decode_blocks=decode_blocks,
        decode_attn_tokens=attn_tokens,
        decode_groups=groups,
        attn_pairs=attn_pairs,
        prefill_ctx_tokens=prefill_ctx,
        swap_tokens=swap_pages * page_tokens,
    )


def decode_attention(lens: list[int], page_tokens: int) -> tuple[int, int]:
    """(padded key slots, groups) of the torch executor's decode attention, grouped as it groups them."""
    if not lens:
        return 0, 0
    groups = group_decode_rows(lens)
    slots = sum(len(g) * -(-lens[g[0]] // page_tokens) * page_tokens for g in groups)
    return slots, len(groups)


class SimExecutor:
    """An `engine.executor.Executor` that costs steps instead of computing them. `cost` is the cost model's
    part (vLLM's mode, `tuner.vllm.sim`, overrides it); the clock, the counters and the tokens are shared."""

    device = "sim"

    def __init__(self, profile: CostProfile, clock: VirtualClock, *, jitter_seed: int | None = None) -> None:
        self.profile = profile
        # With a seed, every step's cost is scaled by a draw from the profile's step_jitter: the spread of
        # a real machine's steps around their mean, which feeds queueing (and so the tail) on its own.
        self._rng = random.Random(jitter_seed) if jitter_seed is not None and profile.step_jitter else None
        self.model_cfg = profile.model.config
        self.clock = clock
        self.page_tokens = 8
        self.steps = 0
        self.busy_s = 0.0

    @property
    def bytes_per_token(self) -> int:
        return self.profile.model.kv_bytes_per_token

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None:
        self.page_tokens = page_tokens

    def cost(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[float, float]:
        """(seconds the clock advances, seconds the step computes): one and the same for kvpilot's engine."""
        cost = self.profile.predict(step_shape(out, kv, self.page_tokens))
        if self._rng is not None:
            cost *= self.profile.jitter(self._rng.random())
        return cost, cost

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult:
        cycle, elapsed = self.cost(out, kv)
        self.clock.advance(cycle)
        self.steps += 1
        self.busy_s += elapsed
        # Any non-EOS token will do: workloads fix output lengths with ignore_eos.
        tokens = [(len(item.seq.token_ids) % 250) + 1 if item.samples else None for item in out.scheduled]
        return ExecuteResult(tokens, elapsed)

    def release(self, seq_ids: Iterable[int]) -> None:
        return None


def sim_engine(
    config: EngineConfig,
    profile: CostProfile,
    *,
    sink: EventSink | None = None,
    stat_loggers: Iterable[StatLogger] = (),
    start_wall: float = 1_700_000_000.0,
    jitter_seed: int | None = None,
) -> tuple[LLMEngine, VirtualClock]:
    """An LLMEngine on the profile's cost model and a virtual clock (starting at `start_wall`).

    Steps cost the model's mean unless `jitter_seed` is given (and the profile has a `step_jitter`):
    then each step draws its factor from the calibration's spread, reproducibly for the seed."""
    clock = VirtualClock(start_wall=start_wall)
    executor = SimExecutor(profile, clock, jitter_seed=jitter_seed)
    cfg = profile.engine_config(config)
    engine = LLMEngine(cfg, executor=executor, clock=clock, sink=sink, stat_loggers=stat_loggers)
    return engine, clock
