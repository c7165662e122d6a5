"""The synthetic fleet of `kvpilot bench fleet`: simulated engines, their history, OTLP spans and DCGM pages.

Each simulated engine emits what kvpilot's engine does, at a busy H200's rates (`Rates`): steps, finished
requests with their two allocation records (alloc, free) and a gauge sample a second. Latencies are
lognormal (long right tails, as measured TTFT and e2e are), queue depth and KV usage wander within bounds.

A sender process (`python -m benchmarks.fleet_load sender CONFIG`) plays a slice of the fleet the way
`engine.http_sink` ships it: per instance, the events since its last push in one batch of at most
`batch_events`, POSTed with an Idempotency-Key kept across retries. When the machine cannot keep up, an
instance's batch covers a longer interval, thinned to `batch_events` (the sink's queue would overflow the
same way): what was offered and what was sent are both reported. Instances in `otlp_instances` send their
requests as OTLP spans (POST /v1/traces, vLLM's attribute names) instead of request events. The few `hot`
engines (the alert trials: their queue jumps at a set time) each ship from a thread of their own.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

LIVE_RUN = "fleet-live"
HISTORY_RUN = "fleet-history"
HISTORY_S = 86_400.0  # the history loaded before the live run spans a day
HISTORY_SLICES = 96  # written in time order, 15 minutes at a time
GPUS_PER_NODE = 8
HOT_QUEUE_DEPTH = 500  # far above the bench rule's threshold; the fleet's own stays below 64


@dataclass(frozen=True)
class Rates:
    """Events per second of one engine."""

    step: float = 50.0
    request: float = 2.0  # each brings an alloc and a free record
    sample: float = 1.0

    @property
    def total(self) -> float:
        return self.step + 3 * self.request + self.sample


@dataclass
class Engine:
    """One simulated engine: its counters, wandering gauges and a seeded random stream."""

    instance: str
    run_id: str
    rng: random.Random
    step: int = 0
    request: int = 0
    kv: float = 0.4
    queue: int = 2
    hot_from: float | None = None  # from this time on its queue is HOT_QUEUE_DEPTH (the alert trial)
    batches: int = 0
    carry: dict[str, float] = field(default_factory=lambda: {"step": 0.0, "request": 0.0, "sample": 0.0})

    def events(self, start: float, end: float, rates: Rates, cap: int) -> tuple[list[dict[str, Any]], int]:
        """The events of [start, end), thinned to at most `cap`; also how many were offered."""
        counts = {}
        for kind in ("step", "request", "sample"):
            exact = getattr(rates, kind) * (end - start) + self.carry[kind]
            counts[kind] = int(exact)
            self.carry[kind] = exact - counts[kind]
        offered = counts["step"] + 3 * counts["request"] + counts["sample"]
        return self.emit(start, end, thinned(counts, cap)), offered

    def emit(self, start: float, end: float, counts: dict[str, int]) -> list[dict[str, Any]]:
        """`counts[kind]` events of each kind spread evenly over [start, end)."""
        out: list[dict[str, Any]] = []
        for kind, n in counts.items():
            for i in range(n):
                ts = start + (end - start) * (i + 1) / (n + 1)
                out.extend(getattr(self, f"_{kind}")(ts))
        return out

    def _base(self, ts: float) -> dict[str, Any]:
        return {"instance": self.instance, "run_id": self.run_id, "ts": ts}

    def _step(self, ts: float) -> list[dict[str, Any]]:
        self.step += 1
        self.kv = min(0.95, max(0.05, self.kv + self.rng.gauss(0, 0.01)))
        self.queue = min(63, max(0, self.queue + self.rng.choice((-1, 0, 0, 1))))
        duration = self.rng.lognormvariate(math.log(0.018), 0.25)
        return [
            {
                **self._base(ts),
                "type": "step",
                "step": self.step,
                "duration_s": duration,
                "forward_s": duration * 0.85,
                "num_seqs": self.rng.randint(8, 64),
                "prefill_tokens": self.rng.choice((0, 0, 0, 512, 2048)),
                "decode_tokens": self.rng.randint(8, 64),
                "kv_blocks_used": int(self.kv * 8192),
                "kv_blocks_total": 8192,
                "queue_depth": self.queue,
                "busy_s": duration * 0.95,
            }
        ]

    def request_fields(self) -> dict[str, Any]:
        self.request += 1
        queue = self.rng.lognormvariate(math.log(0.02), 1.0)
        prefill = self.rng.lognormvariate(math.log(0.06), 0.6)
        decode = self.rng.lognormvariate(math.log(2.5), 0.7)
        return {
            "request_id": f"{self.instance}-{self.request}",
            "prompt_tokens": int(self.rng.lognormvariate(math.log(900), 0.8)),
            "output_tokens": int(self.rng.lognormvariate(math.log(250), 0.7)) + 1,
            "queue_s": queue,
            "prefill_s": prefill,
            "decode_s": decode,
        }

    def _request(self, ts: float) -> list[dict[str, Any]]:
        r = self.request_fields()
        blocks = r["prompt_tokens"] // 16 + 1
        alloc = {"type": "alloc", "request_id": r["request_id"], "blocks": blocks, "block_size": 16}
        alloc["bytes"] = blocks * 16 * 131072
        ttft = r["queue_s"] + r["prefill_s"]
        return [
            {
                **self._base(ts),
                "type": "request",
                "status": "finished",
                **r,
                "frontend_s": 0.0,
                "ttft_s": ttft,
                "e2e_s": ttft + r["decode_s"],
                "cached_tokens": self.rng.choice((0, 0, 256, 512)),
                "finish_reason": "stop",
            },
            {**self._base(ts - r["decode_s"]), **alloc, "op": "alloc", "usage_after": self.kv},
            {**self._base(ts), **alloc, "op": "free", "usage_after": self.kv},
        ]

    def _sample(self, ts: float) -> list[dict[str, Any]]:
        hot = self.hot_from is not None and ts >= self.hot_from
        return [
            {
                **self._base(ts),
                "type": "sample",
                "utilization": min(1.0, max(0.0, self.rng.gauss(0.8, 0.1))),
                "memory_used_bytes": 120 * 2**30,
                "memory_total_bytes": 141 * 2**30,
                "kv_usage": self.kv,
                "queue_depth": HOT_QUEUE_DEPTH if hot else self.queue,
                "running": self.rng.randint(8, 64),
            }
        ]


def instance_name(i: int) -> str:
    return f"fleet-{i:04d}"


def thinned(counts: dict[str, int], cap: int) -> dict[str, int]:
    """`counts` (events per kind; a request is 3 events) scaled down to at most `cap` events, the mix kept."""
    offered = counts["step"] + 3 * counts["request"] + counts["sample"]
    if offered <= cap:
        return counts
    return {k: math.floor(v * cap / offered) for k, v in counts.items()}


def history_batches(
    instances: int,
    events_per_instance: int,
    end: float,
    *,
    span_s: float = HISTORY_S,
    slices: int = HISTORY_SLICES,
    seed: int = 7,
) -> Iterator[list[dict]]:
    """The history before `end`, in time order as a fleet writes it: per slice of `span_s`, every instance's events
    of that slice. Each instance has `events_per_instance` events over the span (thinned, the engines' mix of
    types kept: a day of a real fleet is billions of rows), spread over the slices so that a window of the last
    hour reads its share of them, and the table's time order is what BRIN indexes see in production."""
    rates = Rates()
    engines = [Engine(instance_name(i), HISTORY_RUN, random.Random(seed * 100_003 + i)) for i in range(instances)]
    whole = {kind: int(getattr(rates, kind) * span_s) for kind in ("step", "request", "sample")}
    total = thinned(whole, events_per_instance)
    width = span_s / slices
    for k in range(slices):
        counts = {kind: n * (k + 1) // slices - n * k // slices for kind, n in total.items()}
        lo = end - span_s + k * width
        yield [e for engine in engines for e in engine.emit(lo, lo + width, counts)]


# --- OTLP -----------------------------------------------------------------------------------------


def otlp_body(engine: Engine, stamps: list[float]) -> bytes:
    """An OTLP/protobuf export of one `llm_request` span per stamp (its end), vLLM's attribute names."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    def kv(key: str, value: str | float | int) -> KeyValue:
        if isinstance(value, str):
            return KeyValue(key=key, value=AnyValue(string_value=value))
        if isinstance(value, int):
            return KeyValue(key=key, value=AnyValue(int_value=value))
        return KeyValue(key=key, value=AnyValue(double_value=value))

    export = ExportTraceServiceRequest()
    resource_spans = export.resource_spans.add()
    resource_spans.resource.attributes.extend(
        [kv("service.name", "vllm"), kv("service.instance.id", engine.instance), kv("kvpilot.run_id", engine.run_id)]
    )
    scope = resource_spans.scope_spans.add()
    for end in stamps:
        r = engine.request_fields()
        e2e = r["queue_s"] + r["prefill_s"] + r["decode_s"]
        span = scope.spans.add(
            trace_id=engine.rng.randbytes(16),
            span_id=engine.rng.randbytes(8),
            name="llm_request",
            kind=Span.SPAN_KIND_SERVER,
            start_time_unix_nano=int((end - e2e) * 1e9),
            end_time_unix_nano=int(end * 1e9),
        )
        attributes = {
            "gen_ai.request.id": r["request_id"],
            "gen_ai.usage.prompt_tokens": r["prompt_tokens"],
            "gen_ai.usage.completion_tokens": r["output_tokens"],
            "gen_ai.latency.time_in_queue": r["queue_s"],
            "gen_ai.latency.time_in_model_prefill": r["prefill_s"],
            "gen_ai.latency.time_in_model_decode": r["decode_s"],
            "gen_ai.latency.time_to_first_token": r["queue_s"] + r["prefill_s"],
            "gen_ai.latency.e2e": e2e,
        }
        span.attributes.extend(kv(k, v) for k, v in attributes.items())
    return export.SerializeToString()


# --- DCGM ------------------------------------------------------------------------------------------

_DCGM_FAMILIES = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", lambda r: r.randint(60, 100)),
    ("DCGM_FI_DEV_FB_USED", "gauge", lambda r: r.randint(100_000, 130_000)),
    ("DCGM_FI_DEV_FB_FREE", "gauge", lambda r: r.randint(5_000, 30_000)),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", lambda r: r.randint(40, 80)),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", lambda r: round(r.uniform(300, 700), 1)),
)


def dcgm_page(node: int, rng: random.Random) -> bytes:
    """One node's dcgm-exporter page: 8 GPUs, the families kvpilot maps and one it drops."""
    lines = []
    for name, kind, value in _DCGM_FAMILIES:
        lines.append(f"# TYPE {name} {kind}")
        for gpu in range(GPUS_PER_NODE):
            labels = f'gpu="{gpu}",UUID="GPU-{node:04d}-{gpu}",modelName="NVIDIA H200",Hostname="node-{node}"'
            lines.append(f"{name}{{{labels}}} {value(rng)}")
    return ("\n".join(lines) + "\n").encode()


# --- sender process -----------------------------------------------------------------------------------


def sender_main(config: dict[str, Any]) -> dict[str, Any]:
    """Play `config["instances"]` until `config["until"]` (epoch s); returns what was offered, sent, acked."""
    import httpx

    rates = Rates(**config["rates"])
    otlp = set(config["otlp_instances"])
    hot = config["hot"]
    engines = [
        Engine(name, LIVE_RUN, random.Random(zlib.crc32(name.encode())), hot_from=hot.get(name))
        for name in config["instances"]
    ]
    lock = threading.Lock()
    queue = list(engines)
    last: dict[str, float] = {}
    report: dict[str, Any] = {"offered": 0, "acked": {}, "unacked": 0, "lags": [], "first_hot": {}, "failures": []}
    headers = {"Authorization": f"Bearer {config['token']}"}

    def post(client: httpx.Client, path: str, body: bytes, kind_headers: dict[str, str]) -> bool:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                resp = client.post(config["url"] + path, content=body, headers={**headers, **kind_headers})
            except httpx.HTTPError as exc:
                report["failures"].append(f"{type(exc).__name__}")
                time.sleep(0.2)
                continue
            if resp.status_code in (200, 202):
                return True
            report["failures"].append(f"{resp.status_code}: {resp.text[:120]}")
            if resp.status_code not in (408, 429, 503):
                return False
            time.sleep(0.2)
        return False

    def ship(client: httpx.Client, engine: Engine) -> None:
        now = time.time()
        events, offered = engine.events(last[engine.instance], now, rates, config["batch_events"])
        last[engine.instance] = now
        if not events:
            return
        spans = []
        if engine.instance in otlp:
            spans = [e["ts"] for e in events if e["type"] == "request"]
            events = [e for e in events if e["type"] != "request"]
        engine.batches += 1
        key = f"{engine.instance}-{engine.batches}"
        body = json.dumps({"events": events}).encode()
        ok = post(client, "/v1/ingest", body, {"Idempotency-Key": key, "Content-Type": "application/json"})
        if ok and spans:
            otlp_headers = {"Content-Type": "application/x-protobuf"}
            ok = post(client, "/v1/traces", otlp_body(engine, spans), otlp_headers)
        done = time.time()
        with lock:
            report["offered"] += offered
            if not ok:
                report["unacked"] += len(events) + len(spans)
                return
            for e in events:
                report["acked"][e["type"]] = report["acked"].get(e["type"], 0) + 1
            report["acked"]["request"] = report["acked"].get("request", 0) + len(spans)
            report["lags"].append(done - min(e["ts"] for e in events))
            if engine.hot_from is not None and engine.instance not in report["first_hot"]:
                stamps = [e["ts"] for e in events if e["type"] == "sample" and e["queue_depth"] == HOT_QUEUE_DEPTH]
                if stamps:
                    report["first_hot"][engine.instance] = min(stamps)

    def worker() -> None:
        """Take the engine shipped longest ago (never one another thread holds), ship it, put it back."""
        with httpx.Client(timeout=60.0) as client:
            while time.time() < config["until"]:
                with lock:
                    engine = queue.pop(0) if queue else None
                if engine is None or time.time() - last[engine.instance] < config["min_interval_s"]:
                    if engine is not None:
                        with lock:
                            queue.insert(0, engine)
                    time.sleep(0.01)
                    continue
                try:
                    ship(client, engine)
                finally:
                    with lock:
                        queue.append(engine)

    def own_sink(engine: Engine) -> None:
        """A hot engine ships on its own, every `min_interval_s`, as each engine's sink does: its alert's
        delay is then the collector's, the evaluator's and the delivery's, not the shared pool's backlog."""
        with httpx.Client(timeout=60.0) as client:
            while time.time() < config["until"]:
                time.sleep(max(0.0, last[engine.instance] + config["min_interval_s"] - time.time()))
                ship(client, engine)

    while time.time() < config["start"]:
        time.sleep(0.01)
    begin = time.time()  # a sender that started late has no events from before it ran
    last.update((e.instance, begin) for e in engines)
    hot_engines = [e for e in engines if e.hot_from is not None]
    queue[:] = [e for e in engines if e.hot_from is None]
    threads = [threading.Thread(target=worker) for _ in range(config["threads"])]
    threads += [threading.Thread(target=own_sink, args=(e,)) for e in hot_engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["failures"] = report["failures"][:5]
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["sender"]:
        print(json.dumps(sender_main(json.loads(sys.argv[2]))))
