"""Turns engine stats into the wire events of `engine.events` and hands them to a sink.

Events are built with `model_construct` (no validation): the engine produces them from its own typed
state, and the collector validates on ingest anyway — validating twice would cost the serving loop.
Samples (gauges) go out every `sample_interval_s`; on CPU utilization is the busy fraction, the
share of wall time spent inside the model forward over the interval.
"""

from __future__ import annotations

import uuid
from typing import cast

from engine.clock import Clock
from engine.device_stats import DeviceSampler
from engine.events import AllocEvent, AllocOp, RequestEvent, RequestStatus, SampleEvent, StepEvent, Tier
from engine.kv import KVCacheManager
from engine.sinks import EventSink
from engine.stats import FinishedRequest, IterationStats


class EventLogger:
    """A StatLogger that emits request/step/alloc/sample events to an `EventSink`."""

    def __init__(
        self,
        sink: EventSink,
        clock: Clock,
        *,
        instance: str,
        run_id: str | None = None,
        sample_interval_s: float = 1.0,
        device: DeviceSampler | None = None,
    ) -> None:
        self.sink = sink
        self.clock = clock
        self.instance = instance
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.sample_interval_s = sample_interval_s
        self.device = device
        self.kv: KVCacheManager | None = None
        self._last_sample = clock.now()
        self._busy_since_sample = 0.0
        self._swaps_since_sample = 0
        self._prefix = (0, 0)
        self.last_utilization = 0.0

    def bind(self, kv: KVCacheManager) -> None:
        self.kv = kv
        kv.trace = self.on_alloc

    def _base(self) -> dict:
        return {"v": 1, "instance": self.instance, "run_id": self.run_id, "ts": self.clock.wall()}

    # KV trace callback (engine.kv.manager.TraceFn)
    def on_alloc(self, op: str, request_id: str | None, blocks: int, block_size: int, tier: str) -> None:
        kv = self.kv
        if kv is None:  # only a bound manager traces
            return
        usage = kv.usage() if tier == "hot" else (kv.cold.used_pages / kv.cold.num_pages if kv.cold.num_pages else 0.0)
        self.sink.emit(
            AllocEvent.model_construct(
                **self._base(),
                type="alloc",
                op=cast(AllocOp, op),  # the manager's op names are the contract's
                request_id=request_id,
                blocks=blocks,
                block_size=block_size,
                bytes=blocks * block_size * kv.bytes_per_token,
                tier=cast(Tier, tier),
                usage_after=min(1.0, usage),
            )
        )

    def record(self, stats: IterationStats) -> None:
        base = self._base()
        self.sink.emit(
            StepEvent.model_construct(
                **base,
                type="step",
                step=stats.step,
                duration_s=stats.duration_s,
                forward_s=stats.forward_s,
                num_seqs=stats.num_seqs,
                prefill_tokens=stats.prefill_tokens,
                decode_tokens=stats.decode_tokens,
                kv_blocks_used=stats.kv.hot_pages_used,
                kv_blocks_total=stats.kv.hot_pages_total,
                queue_depth=stats.queue_depth,
                busy_s=stats.forward_s,
                preemptions=stats.preemptions,
                swapped_seqs=stats.swapped,
                warmup=stats.warmup,
            )
        )
        for req in stats.finished:
            self.sink.emit(self._request_event(req, base))
        self._busy_since_sample += stats.forward_s
        self._swaps_since_sample += stats.swaps_out + stats.swaps_in
        self.maybe_sample(queue_depth=stats.queue_depth, running=stats.running)

    def record_rejected(self, request: FinishedRequest) -> None:
        self.sink.emit(self._request_event(request, self._base()))

    def _request_event(self, req: FinishedRequest, base: dict) -> RequestEvent:
        return RequestEvent.model_construct(
            **base,
            type="request",
            request_id=req.request_id,
            status=cast(RequestStatus, req.status),
            priority=req.priority,
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
            frontend_s=0.0,  # the arrival is stamped in the HTTP handler (AsyncEngine.submit): nothing before it
            queue_s=req.queue_s,
            prefill_s=req.prefill_s,
            ttft_s=req.ttft_s,
            decode_s=req.decode_s,
            e2e_s=req.e2e_s,
            preemptions=req.preemptions,
            swaps=req.swaps,
            swap_s=req.swap_s,
            cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            warmup=req.warmup,
        )

    def maybe_sample(self, *, queue_depth: int, running: int, force: bool = False) -> None:
        now = self.clock.now()
        elapsed = now - self._last_sample
        if (elapsed < self.sample_interval_s and not force) or elapsed <= 0 or self.kv is None:
            return
        kv = self.kv.stats()
        utilization = min(1.0, self._busy_since_sample / elapsed)
        self.last_utilization = utilization
        queries = kv.prefix_queries - self._prefix[0]
        hits = kv.prefix_hits - self._prefix[1]
        self._prefix = (kv.prefix_queries, kv.prefix_hits)
        used = (kv.hot_pages_used - kv.cached_pages) * self.kv.page_bytes
        total = kv.hot_pages_total * self.kv.page_bytes
        source = "engine"
        if self.device is not None:
            dev = self.device.sample()
            if dev is not None:
                used, total, source = dev.memory_used_bytes, dev.memory_total_bytes, dev.source
                if dev.utilization is not None:
                    utilization = dev.utilization
        self.sink.emit(
            SampleEvent.model_construct(
                **self._base(),
                type="sample",
                utilization=utilization,
                memory_used_bytes=used,
                memory_total_bytes=total,
                kv_usage=min(1.0, kv.usage),
                cold_usage=min(1.0, kv.cold_usage),
                fragmentation=kv.fragmentation,
                internal_waste=kv.internal_waste,
                queue_depth=queue_depth,
                running=running,
                swap_rate=self._swaps_since_sample / elapsed,
                prefix_hit_rate=hits / queries if queries else None,
                source=source,
            )
        )
        self._last_sample = now
        self._busy_since_sample = 0.0
        self._swaps_since_sample = 0
