"""The engine: add requests, then `step()` — schedule -> execute -> postprocess -> stats.

Not thread-safe by design: one loop owns it (`engine.async_engine` runs that loop for the server;
benchmarks and the tuner's simulator call `step()` directly). Clock, executor and sink are injected.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.clock import Clock, RealClock
from engine.config import PRIORITY_CLASSES, EngineConfig
from engine.device_stats import DeviceSampler
from engine.executor import Executor, TorchExecutor
from engine.kv import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, SeqStatus, Sequence, StageTimes
from engine.sinks import EventSink, MemorySink
from engine.stats import FinishedRequest, IterationStats, StatLogger
from engine.telemetry import EventLogger
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger("kvpilot.engine")


class InvalidRequestError(ValueError):
    """A request the engine can never serve; `field` names the offending input (HTTP 400/422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """Admission control: the waiting queue is at its limit (HTTP 429); the request was not queued."""


@dataclass(slots=True)
class RequestOutput:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool


def parse_priority(value: str | int) -> int:
    if isinstance(value, str):
        if value not in PRIORITY_CLASSES:
            raise InvalidRequestError("priority", f"unknown priority {value!r}; one of {list(PRIORITY_CLASSES)}")
        return PRIORITY_CLASSES.index(value)
    if isinstance(value, bool) or not 0 <= value < len(PRIORITY_CLASSES):
        raise InvalidRequestError("priority", f"priority must be 0..{len(PRIORITY_CLASSES) - 1}, got {value!r}")
    return value


def make_tokenizer(cfg: EngineConfig) -> Tokenizer:
    if cfg.model.checkpoint:
        path = Path(cfg.model.checkpoint) / "tokenizer.json"
        if path.is_file():
            try:
                return HFTokenizer(path, bos_token_id=1, eos_token_id=2)
            except ImportError:
                log.warning("%s present but the `tokenizers` package is missing; using bytes", path)
    return ByteTokenizer()


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        executor: Executor | None = None,
        clock: Clock | None = None,
        sink: EventSink | None = None,
        stat_loggers: Iterable[StatLogger] = (),
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or RealClock()
        self.executor = executor or TorchExecutor(config)
        self.model_cfg = self.executor.model_cfg
        self.tokenizer = tokenizer or make_tokenizer(config)
        self.sink = sink if sink is not None else MemorySink()
        tcfg = config.telemetry
        self.events = EventLogger(
            self.sink,
            self.clock,
            instance=tcfg.instance,
            run_id=tcfg.run_id,
            sample_interval_s=tcfg.sample_interval_s,
            device=DeviceSampler.for_device(self.executor.device),
        )
        self.loggers: list[StatLogger] = [self.events, *stat_loggers]
        self.kv = KVCacheManager(config.cache, bytes_per_token=self.executor.bytes_per_token)
        if tcfg.trace_alloc:
            self.events.bind(self.kv)
        else:
            self.events.kv = self.kv
        self.executor.allocate_cache(self.kv.hot.num_pages, self.kv.cold.num_pages, config.cache.page_tokens)
        self.scheduler = Scheduler(
            config.scheduler,
            config.recycler,
            self.kv,
            eos_token_id=self.tokenizer.eos_token_id,
            max_model_len=self.model_cfg.max_position,
        )
        self._ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._rng = random.Random(self.model_cfg.seed)
        self.warming_up = False

    @property
    def run_id(self) -> str:
        return self.events.run_id

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Reject what can never be served (before it takes a queue slot)."""
        scfg = self.config.server
        if len(prompt_ids) == 0:
            raise InvalidRequestError("prompt", "prompt is empty")
        if len(prompt_ids) > scfg.max_prompt_tokens:
            raise InvalidRequestError(
                "prompt", f"prompt has {len(prompt_ids)} tokens; the limit is {scfg.max_prompt_tokens}"
            )
        if not 1 <= params.max_tokens <= scfg.max_tokens_limit:
            raise InvalidRequestError("max_tokens", f"max_tokens must be 1..{scfg.max_tokens_limit}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.model_cfg.max_position:
            raise InvalidRequestError(
                "max_tokens", f"prompt + max_tokens = {total} exceeds {self.model_cfg.max_position} model positions"
            )
        if self.kv.pages_needed(total) > self.kv.hot.num_pages - self.kv.watermark_pages:
            raise InvalidRequestError(
                "max_tokens", f"prompt + max_tokens = {total} tokens cannot fit in the KV pool even alone"
            )
        if max(prompt_ids) >= self.model_cfg.vocab_size or min(prompt_ids) < 0:
            raise InvalidRequestError("prompt", "token id outside the vocabulary")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise InvalidRequestError("temperature", "temperature must be >= 0 and top_p in (0, 1]")

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        priority: str | int = "normal",
        request_id: str | None = None,
        warmup: bool = False,
        arrival: float | None = None,
    ) -> Sequence:
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        prio = parse_priority(priority)
        self.validate(prompt_ids, params)
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=self._rng.getrandbits(62))
        seq_id = next(self._ids)
        request_id = request_id or f"req-{seq_id}"
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"request {request_id!r} is already running")
        now = self.clock.now()
        seq = Sequence(
            seq_id, request_id, prompt_ids, params, prio, StageTimes(arrival if arrival is not None else now)
        )
        seq.warmup = warmup
        if len(self.scheduler.waiting) >= self.config.scheduler.queue_limit:
            self.reject(seq)
            raise QueueFullError(f"queue is full ({self.config.scheduler.queue_limit} waiting); retry later")
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def reject(self, seq: Sequence) -> None:
        """Record a request refused by admission control (it never entered the queue)."""
        now = self.clock.now()
        seq.times.finished = now
        seq.finish_reason = "rejected"
        rec = self.request_record(seq, "rejected")
        for logger in self.loggers:
            logger.record_rejected(rec)

    def abort(self, request_id: str) -> bool:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self.executor.release([seq.seq_id])
        seq.finish_reason = "abort"
        seq.times.finished = self.clock.now()
        rec = self.request_record(seq, "aborted")
        for logger in self.loggers:
            logger.record_rejected(rec)
        return True

    def get_request(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = self.clock.now()
        out = self.scheduler.schedule(t0)
        if out.is_empty:
            self.events.maybe_sample(queue_depth=len(self.scheduler.waiting), running=len(self.scheduler.running))
            return []
        result = self.executor.execute(out, self.kv)
        now = self.clock.now()
        upd = self.scheduler.update(out, result.tokens, now)
        outputs: dict[int, RequestOutput] = {}
        for seq, token in upd.new_tokens:
            ro = outputs.get(seq.seq_id)
            if ro is None:
                outputs[seq.seq_id] = RequestOutput(seq, [token], seq.status == SeqStatus.FINISHED)
            else:
                ro.new_token_ids.append(token)
        finished = []
        for seq in upd.finished:
            self._requests.pop(seq.request_id, None)
            finished.append(self.request_record(seq, "finished"))
        if upd.finished:
            self.executor.release(s.seq_id for s in upd.finished)
        stats = IterationStats(
            step=out.step,
            duration_s=now - t0,
            forward_s=result.forward_s,
            num_seqs=len(out.scheduled),
            prefill_tokens=out.num_prefill_tokens,
            decode_tokens=out.num_decode_tokens,
            queue_depth=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            swapped=len(self.scheduler.swapped),
            preemptions=len(out.preempted),
            swaps_out=len(out.swap_out),
            swaps_in=len(out.swap_in),
            generated_tokens=len(upd.new_tokens),
            oom_events=out.num_oom,
            warmup=self.warming_up,
            kv=self.kv.stats(),
            finished=finished,
            inter_token_s=upd.inter_token_s,
        )
        for logger in self.loggers:
            logger.record(stats)
        return list(outputs.values())

    def request_record(self, seq: Sequence, status: str) -> FinishedRequest:
        t = seq.times
        end = t.finished if t.finished is not None else self.clock.now()
        scheduled = t.scheduled if t.scheduled is not None else end
        prefill_done = t.prefill_done if t.prefill_done is not None else end
        first = t.first_token
        return FinishedRequest(
            request_id=seq.request_id,
            status=status,
            priority=seq.priority,
            prompt_tokens=seq.num_prompt_tokens,
            output_tokens=seq.num_output_tokens,
            queue_s=max(0.0, scheduled - t.arrival),
            prefill_s=max(0.0, prefill_done - scheduled),
            ttft_s=max(0.0, first - t.arrival) if first is not None else None,
            decode_s=max(0.0, end - first) if first is not None else 0.0,
            e2e_s=max(0.0, end - t.arrival),
            preemptions=seq.preemptions,
            swaps=seq.swaps,
            swap_s=t.swap_s + (end - t.swapped_at if t.swapped_at is not None else 0.0),
            cached_tokens=seq.num_cached_tokens,
            finish_reason=seq.finish_reason,
            warmup=seq.warmup,
        )

    # ------------------------------------------------------------------ offline helpers
    def run_until_done(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_unfinished():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"engine did not finish within {max_steps} steps")

    def generate(
        self, prompts: Seq[str | Seq[int]], params: SamplingParams | None = None, **kwargs: Any
    ) -> list[Sequence]:
        seqs = [self.add_request(p, params, **kwargs) for p in prompts]
        self.run_until_done()
        return seqs

    def warmup(self, n: int | None = None) -> int:
        """Run `n` synthetic requests (default: config, 100 on CUDA, 4 on CPU) marked as warm-up."""
        wcfg = self.config.warmup
        if n is None:
            n = wcfg.requests if wcfg.requests is not None else (100 if self.executor.device == "cuda" else 4)
        if n <= 0:
            return 0
        self.warming_up = True
        try:
            rng = random.Random(1234)
            params = SamplingParams(max_tokens=wcfg.max_tokens, ignore_eos=True)
            for i in range(n):
                prompt = [self.tokenizer.bos_token_id] + [rng.randrange(256) for _ in range(wcfg.prompt_tokens)]
                self.add_request(prompt, params, request_id=f"warmup-{i}", warmup=True)
            self.run_until_done()
        finally:
            self.warming_up = False
        return n

    # ------------------------------------------------------------------ hot reload
    def reconfigure(self, patch: dict) -> EngineConfig:
        """Apply a patch of tunable fields between steps; raises ConfigError naming the field."""
        new = self.config.with_tunable(patch)
        self.scheduler.reconfigure(new.scheduler, new.recycler)
        self.kv.set_policy(new.cache)
        self.config = new
        log.info("reconfigured: %s", patch)
        return new
