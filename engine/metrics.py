"""The engine's Prometheus metrics, on an injected registry (prometheus client_python style: each test
uses a fresh one). Names are kvpilot's own; collector/series.py maps them to canonical series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.stats import FinishedRequest, IterationStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusStatLogger:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queue_depth = Gauge("kvpilot_queue_depth", "Requests waiting to be scheduled.", registry=r)
        self.running = Gauge("kvpilot_running_seqs", "Sequences in the running batch.", registry=r)
        self.swapped = Gauge("kvpilot_swapped_seqs", "Sequences swapped out to the host tier.", registry=r)
        self.kv_usage = Gauge("kvpilot_kv_usage", "Hot-tier KV pages held by sequences (0-1).", registry=r)
        self.kv_occupancy = Gauge(
            "kvpilot_kv_occupancy", "Hot-tier pages in use, cached prefix blocks included (0-1).", registry=r
        )
        self.kv_cold = Gauge("kvpilot_kv_cold_usage", "Cold-tier (host) KV pool usage (0-1).", registry=r)
        self.kv_frag = Gauge(
            "kvpilot_kv_fragmentation", "Share of free KV memory unable to serve the largest block size.", registry=r
        )
        self.kv_waste = Gauge(
            "kvpilot_kv_internal_waste", "Share of allocated KV token slots not holding a token.", registry=r
        )
        self.utilization = Gauge(
            "kvpilot_utilization", "Busy fraction: share of wall time inside the model forward.", registry=r
        )
        self.memory_used = Gauge("kvpilot_memory_used_bytes", "KV pool bytes held by sequences.", registry=r)
        self.memory_total = Gauge("kvpilot_memory_total_bytes", "KV pool bytes in total.", registry=r)
        self.swaps = Counter("kvpilot_swaps", "Sequence swaps between KV tiers.", ["direction"], registry=r)
        self.preemptions = Counter("kvpilot_preemptions", "Sequences preempted on KV exhaustion.", registry=r)
        self.requests = Counter("kvpilot_requests", "Requests that left the engine.", ["status"], registry=r)
        self.rejected = Counter("kvpilot_rejected", "Requests refused by admission control (429).", registry=r)
        self.oom = Counter("kvpilot_oom", "KV allocations that failed and forced a preemption.", registry=r)
        self.prompt_tokens = Counter("kvpilot_prompt_tokens", "Prefill tokens computed.", registry=r)
        self.generation_tokens = Counter("kvpilot_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(
            "kvpilot_time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kvpilot_inter_token_latency_seconds", "Time between tokens of a request.", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kvpilot_e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "kvpilot_queue_time_seconds", "Arrival to first scheduled.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "kvpilot_step_duration_seconds", "Engine iteration wall time.", buckets=_ITL_BUCKETS, registry=r
        )
        for status in ("finished", "aborted", "rejected"):
            self.requests.labels(status)
        for direction in ("out", "in"):
            self.swaps.labels(direction)
        self._page_bytes = 0

    def set_page_bytes(self, page_bytes: int) -> None:
        self._page_bytes = page_bytes

    def record(self, stats: IterationStats) -> None:
        kv = stats.kv
        self.queue_depth.set(stats.queue_depth)
        self.running.set(stats.running)
        self.swapped.set(stats.swapped)
        self.kv_usage.set(kv.usage)
        self.kv_occupancy.set(kv.occupancy)
        self.kv_cold.set(kv.cold_usage)
        self.kv_frag.set(kv.fragmentation)
        self.kv_waste.set(kv.internal_waste)
        self.memory_used.set((kv.hot_pages_used - kv.cached_pages) * self._page_bytes)
        self.memory_total.set(kv.hot_pages_total * self._page_bytes)
        if stats.duration_s > 0:
            self.utilization.set(min(1.0, stats.forward_s / stats.duration_s))
        self.step_time.observe(stats.duration_s)
        if stats.swaps_out:
            self.swaps.labels("out").inc(stats.swaps_out)
        if stats.swaps_in:
            self.swaps.labels("in").inc(stats.swaps_in)
        if stats.preemptions:
            self.preemptions.inc(stats.preemptions)
        if stats.oom_events:
            self.oom.inc(stats.oom_events)
        self.prompt_tokens.inc(stats.prefill_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        for gap in stats.inter_token_s:
            self.itl.observe(gap)
        for req in stats.finished:
            self.requests.labels(req.status).inc()
            if req.ttft_s is not None:
                self.ttft.observe(req.ttft_s)
            self.e2e.observe(req.e2e_s)
            self.queue_time.observe(req.queue_s)

    def record_rejected(self, request: FinishedRequest) -> None:
        self.requests.labels(request.status).inc()
        if request.status == "rejected":
            self.rejected.inc()
