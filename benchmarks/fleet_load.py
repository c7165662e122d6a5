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

import contextlib
import heapq
import http.client
import json
import math
import random
import re
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from collector import bundle
from engine.http_sink import retry_after
from plumbing.sched import outrank

LIVE_RUN = "fleet-live"
SATURATION_RUN = "fleet-saturation"
HISTORY_RUN = "fleet-history"
HISTORY_S = 86_400.0  # the history loaded before the live run spans a day
HISTORY_SLICES = 96  # written in time order, 15 minutes at a time
GPUS_PER_NODE = 8
# An OTLP engine (a vLLM) exports its spans as OpenTelemetry's BatchSpanProcessor does, which vLLM's tracing
# installs with its defaults: what finished, every 5 s (OTEL_BSP_SCHEDULE_DELAY), at most 2,048 queued
# (OTEL_BSP_MAX_QUEUE_SIZE, the rest dropped), once more at shutdown
SPAN_EXPORT_S = 5.0
SPAN_QUEUE = 2048
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


POOL = 127  # values drawn ahead per engine and field (prime: every stride below cycles through all of them)
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # instance and run names written into JSON text as they are

_STEP = (
    '{"type":"step","instance":"%s","run_id":"%s","ts":%.6f,"step":%d,"duration_s":%.6g,"forward_s":%.6g,'
    '"num_seqs":%d,"prefill_tokens":%d,"decode_tokens":%d,"kv_blocks_used":%d,"kv_blocks_total":8192,'
    '"queue_depth":%d,"busy_s":%.6g}'
)
_REQUEST = (
    '{"type":"request","instance":"%s","run_id":"%s","ts":%.6f,"request_id":"%s","status":"finished",'
    '"prompt_tokens":%d,"output_tokens":%d,"frontend_s":0.0,"queue_s":%.6g,"prefill_s":%.6g,"decode_s":%.6g,'
    '"ttft_s":%.6g,"e2e_s":%.6g,"cached_tokens":%d,"finish_reason":"stop"}'
)
_ALLOC = (
    '{"type":"alloc","instance":"%s","run_id":"%s","ts":%.6f,"op":"%s","request_id":"%s","blocks":%d,'
    '"block_size":16,"bytes":%d,"usage_after":%.4f}'
)
_SAMPLE = (
    '{"type":"sample","instance":"%s","run_id":"%s","ts":%.6f,"utilization":%.4f,"memory_used_bytes":%d,'
    '"memory_total_bytes":%d,"kv_usage":%.4f,"queue_depth":%d,"running":%d}'
)


@dataclass(frozen=True)
class Request:
    """One simulated request's figures (lognormal, as measured latencies and lengths are)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float
    cached_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def e2e_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    @property
    def blocks(self) -> int:
        return self.prompt_tokens // 16 + 1


@dataclass
class Rendered:
    """One batch of an engine's events as wire JSON text, and what the sender reports of it."""

    events: list[str]
    counts: dict[str, int]  # events by type
    first_ts: float | None  # the oldest event's time
    finished: list[tuple[float, Request]]  # requests that ended in the batch's interval, with their end
    hot_ts: float | None = None  # the first sample at `HOT_QUEUE_DEPTH`

    def body(self) -> bytes:
        return ('{"events":[' + ",".join(self.events) + "]}").encode()


class Engine:
    """One simulated engine: its counters, wandering gauges, requests in flight, and values drawn ahead from a
    seeded random stream (`POOL` per field, read with co-prime strides), so that rendering an event is one string
    format: the senders share the machine under test, and what they spend is taken from the collectors.

    A request allocates its KV blocks when it starts (an `alloc` event then) and ends `e2e_s` later with its
    `request` and `free` events, as an engine emits them: every event's time is within the interval it is
    rendered for, so a batch's age is its sender's doing and the collector's, not a request's length."""

    def __init__(self, instance: str, run_id: str, rng: random.Random, *, hot_from: float | None = None) -> None:
        if not (_NAME.fullmatch(instance) and _NAME.fullmatch(run_id)):
            raise ValueError(f"instance and run names must match {_NAME.pattern}: {instance!r}, {run_id!r}")
        self.instance, self.run_id, self.rng, self.hot_from = instance, run_id, rng, hot_from
        self.step = self.request = self.batches = 0
        self.kv, self.queue = 0.4, 2
        self.carry = {"step": 0.0, "request": 0.0, "sample": 0.0}
        self.in_flight: list[tuple[float, int, Request]] = []  # (end, request number, request): a heap
        n = range(POOL)
        self._durations = [rng.lognormvariate(math.log(0.018), 0.25) for _ in n]
        self._seqs = [rng.randint(8, 64) for _ in n]
        self._prefill = [rng.choice((0, 0, 0, 512, 2048)) for _ in n]
        self._decode = [rng.randint(8, 64) for _ in n]
        self._kv_moves = [rng.gauss(0, 0.01) for _ in n]
        self._queue_moves = [rng.choice((-1, 0, 0, 1)) for _ in n]
        self._utilization = [min(1.0, max(0.0, rng.gauss(0.8, 0.1))) for _ in n]
        self._requests = [
            (
                int(rng.lognormvariate(math.log(900), 0.8)),
                int(rng.lognormvariate(math.log(250), 0.7)) + 1,
                rng.lognormvariate(math.log(0.02), 1.0),
                rng.lognormvariate(math.log(0.06), 0.6),
                rng.lognormvariate(math.log(2.5), 0.7),
                rng.choice((0, 0, 256, 512)),
            )
            for _ in n
        ]

    def events(self, start: float, end: float, rates: Rates, cap: int, *, spans: bool = False) -> tuple[Rendered, int]:
        """The events of [start, end), thinned to at most `cap`; also how many were offered. `spans`: finished
        requests are left out of the events (their sender ships them as OTLP spans)."""
        counts = {}
        for kind in ("step", "request", "sample"):
            exact = getattr(rates, kind) * (end - start) + self.carry[kind]
            counts[kind] = int(exact)
            self.carry[kind] = exact - counts[kind]
        offered = counts["step"] + 3 * counts["request"] + counts["sample"]
        return self.render(start, end, thinned(counts, cap), spans=spans), offered

    def render(self, start: float, end: float, counts: dict[str, int], *, spans: bool = False) -> Rendered:
        """`counts[kind]` events of each kind spread evenly over [start, end) (a request count starts that many
        requests), and the requests in flight that end within it. Samples are spread over (start, end], the
        last taken at `end`: `engine.http_sink` pushes what is queued when a sample is taken, so a batch is
        cut at its engine's sample."""
        out: list[str] = []
        made = {"step": 0, "alloc": 0, "request": 0, "sample": 0}
        first: float | None = None
        hot_ts: float | None = None
        name, run = self.instance, self.run_id
        width = end - start
        n = counts.get("step", 0)
        for i in range(n):
            ts = start + width * (i + 1) / (n + 1)
            self.step += 1
            j = self.step
            self.kv = min(0.95, max(0.05, self.kv + self._kv_moves[j % POOL]))
            self.queue = min(63, max(0, self.queue + self._queue_moves[(3 * j) % POOL]))
            d = self._durations[(5 * j) % POOL]
            row = (name, run, ts, j, d, d * 0.85, self._seqs[(7 * j) % POOL], self._prefill[(11 * j) % POOL])
            out.append(_STEP % (*row, self._decode[(13 * j) % POOL], int(self.kv * 8192), self.queue, d * 0.95))
        made["step"] = n
        if n:
            first = start + width / (n + 1)
        n = counts.get("request", 0)
        for i in range(n):
            ts = start + width * (i + 1) / (n + 1)
            request = self._start(ts)
            blocks = request.blocks
            out.append(_ALLOC % (name, run, ts, "alloc", request.request_id, blocks, blocks * 16 * 131072, self.kv))
            made["alloc"] += 1
            first = ts if first is None else min(first, ts)
        finished = []
        while self.in_flight and self.in_flight[0][0] < end:
            ts, _, r = heapq.heappop(self.in_flight)
            finished.append((ts, r))
            first = ts if first is None else min(first, ts)
            blocks = r.blocks
            out.append(_ALLOC % (name, run, ts, "free", r.request_id, blocks, blocks * 16 * 131072, self.kv))
            made["alloc"] += 1
            if not spans:
                row = (name, run, ts, r.request_id, r.prompt_tokens, r.output_tokens, r.queue_s, r.prefill_s)
                out.append(_REQUEST % (*row, r.decode_s, r.ttft_s, r.e2e_s, r.cached_tokens))
                made["request"] += 1
        n = counts.get("sample", 0)
        for i in range(n):
            ts = start + width * (i + 1) / n  # the last closes the interval: the sink pushes a sample at once
            hot = self.hot_from is not None and ts >= self.hot_from
            if hot and hot_ts is None:
                hot_ts = ts
            k = (self.step + i) % POOL
            row = (name, run, ts, self._utilization[k], 120 * 2**30, 141 * 2**30, self.kv)
            out.append(_SAMPLE % (*row, HOT_QUEUE_DEPTH if hot else self.queue, self._seqs[(17 * k) % POOL]))
            first = ts if first is None else min(first, ts)
        made["sample"] = n
        return Rendered(out, {k: v for k, v in made.items() if v}, first, finished, hot_ts)

    def _start(self, ts: float) -> Request:
        self.request += 1
        prompt, output, queue, prefill, decode, cached = self._requests[(19 * self.request) % POOL]
        r = Request(f"{self.instance}-{self.request}", prompt, output, queue, prefill, decode, cached)
        heapq.heappush(self.in_flight, (ts + r.e2e_s, self.request, r))
        return r


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as `Http.post` read it."""

    status_code: int
    headers: dict[str, str]  # names lowercased
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """A keep-alive HTTP/1.1 client on `http.client`: one connection per thread and address, reopened after a
    failure; `close` closes every thread's. The senders share the cores of the collectors they measure, so they
    spend as little as an engine's own sink would on its node: httpx cost about a millisecond of CPU a push here."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's, for `close`
        self._lock = threading.Lock()

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        """POST `body`; `OSError` or `http.client.HTTPException` when no answer came (the connection is then closed)."""
        parts = urlsplit(url)
        conns: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        for fresh in (parts.netloc not in conns, True):
            conn = conns.get(parts.netloc)
            if conn is None:
                conn = conns[parts.netloc] = http.client.HTTPConnection(parts.netloc, timeout=self.timeout_s)
                with self._lock:
                    self._open.add(conn)
            try:
                conn.request("POST", parts.path, body=body, headers=headers)
                resp = conn.getresponse()
                content = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                del conns[parts.netloc]
                with self._lock:
                    self._open.discard(conn)
                # a kept connection the server closed while idle (uvicorn keeps one 5 s): once more on a new one
                # (a push is keyed and a span stored once: a second delivery is answered as a duplicate)
                if fresh or not isinstance(
                    exc, ConnectionResetError | BrokenPipeError | http.client.RemoteDisconnected
                ):
                    raise
                continue
            return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, content)
        raise AssertionError("unreachable: the second try is on a new connection")

    def close(self) -> None:
        """Every thread's connections (call it once the threads using this client are done)."""
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()


def instance_name(i: int) -> str:
    return f"fleet-{i:04d}"


def run_of(run: str, instance: str) -> str:
    """An engine's run id in the bench's run `run` (live, saturation, history): its own, as every engine's is (an
    engine draws one when it starts, `engine.telemetry`). One run id shared by the fleet made every insert of
    `ix_steps_run_id_ts` land on the same leaf pages: two writers' COPY took 10-38% more time per row."""
    return f"{run}.{instance}"


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
) -> Iterator[list[str]]:
    """The history before `end`, in time order as a fleet writes it: per slice of `span_s`, every instance's events
    of that slice (each one's JSON text). Each instance has `events_per_instance` events over the span (thinned,
    the engines' mix of types kept: a day of a real fleet is billions of rows), spread over the slices so that a
    window of the last hour reads its share of them, and the table's time order is what BRIN indexes see in
    production."""
    rates = Rates()
    engines = [
        Engine(instance_name(i), run_of(HISTORY_RUN, instance_name(i)), random.Random(seed * 100_003 + i))
        for i in range(instances)
    ]
    whole = {kind: int(getattr(rates, kind) * span_s) for kind in ("step", "request", "sample")}
    total = thinned(whole, events_per_instance)
    width = span_s / slices
    for k in range(slices):
        counts = {kind: n * (k + 1) // slices - n * k // slices for kind, n in total.items()}
        lo = end - span_s + k * width
        yield [e for engine in engines for e in engine.render(lo, lo + width, counts).events]


# --- OTLP -----------------------------------------------------------------------------------------


def otlp_body(exports: list[tuple[Engine, list[tuple[float, Request]]]]) -> bytes:
    """An OTLP/protobuf export of one `llm_request` span per finished request (at its end), vLLM's attribute
    names; a resource per engine (several: a node's OpenTelemetry agent batching its engines' spans)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    export = ExportTraceServiceRequest()
    for engine, finished in exports:
        resource_spans = export.resource_spans.add()
        resource = {"service.name": "vllm", "service.instance.id": engine.instance, "kvpilot.run_id": engine.run_id}
        resource_spans.resource.attributes.extend(_kv(k, v) for k, v in resource.items())
        scope = resource_spans.scope_spans.add()
        for end, r in finished:
            span = scope.spans.add(
                trace_id=engine.rng.randbytes(16),
                span_id=engine.rng.randbytes(8),
                name="llm_request",
                kind=Span.SPAN_KIND_SERVER,
                start_time_unix_nano=int((end - r.e2e_s) * 1e9),
                end_time_unix_nano=int(end * 1e9),
            )
            attributes = {
                "gen_ai.request.id": r.request_id,
                "gen_ai.usage.prompt_tokens": r.prompt_tokens,
                "gen_ai.usage.completion_tokens": r.output_tokens,
                "gen_ai.latency.time_in_queue": r.queue_s,
                "gen_ai.latency.time_in_model_prefill": r.prefill_s,
                "gen_ai.latency.time_in_model_decode": r.decode_s,
                "gen_ai.latency.time_to_first_token": r.ttft_s,
                "gen_ai.latency.e2e": r.e2e_s,
            }
            span.attributes.extend(_kv(k, v) for k, v in attributes.items())
    return export.SerializeToString()


def _kv(key: str, value: str | float | int) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(double_value=value))


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
    sched = outrank() if config.get("outrank") else None  # before any thread starts: they inherit it
    rates = Rates(**config["rates"])
    otlp = set(config["otlp_instances"])
    hot = config["hot"]
    run = config.get("run_id", LIVE_RUN)
    engines = [
        # seeded by run and name: a second run of the same engines draws its own request and span ids (a span id
        # seen before is stored once, and its second acknowledgement would read as a loss)
        Engine(name, run_of(run, name), random.Random(zlib.crc32(f"{run}/{name}".encode())), hot_from=hot.get(name))
        for name in config["instances"]
    ]
    lock = threading.Lock()
    spans: dict[str, list[tuple[float, Request]]] = {e.instance: [] for e in engines if e.instance in otlp}
    per_node = max(1, config.get("engines_per_node", 1))
    queue: list[list[Engine]] = []
    last: dict[str, float] = {}
    report: dict[str, Any] = {
        "offered": 0,
        "acked": {},
        "unacked": 0,
        "spans_dropped": 0,  # finished requests an OTLP engine's full span queue had no room for
        "first_contact_acked": 0,  # the first pushes' events (`first_contact`), stored before the timed run
        "lags": [],
        # the lag's two parts per batch: its oldest event's age when the push left (the engine's interval and the
        # sender's own backlog), then the push to its answer (the collector: parse, COMMIT, any retry)
        "ages_at_send": [],
        "answers": [],
        "sent_at": [],  # when each of those pushes left (epoch s): where in the run the slow answers fell
        "first_hot": {},
        "hot_stored": {},  # when the push carrying the first hot sample was acknowledged (after its COMMIT)
        "failures": [],
    }
    headers = {"Authorization": f"Bearer {config['token']}"}
    as_json = {"Content-Type": "application/json"}

    def post(
        client: Http,
        path: str,
        body: bytes,
        kind_headers: dict[str, str],
        *,
        results: bool = False,
        base: str | None = None,
        deadline: float | None = None,
    ) -> Any:
        """True once stored (for a bundle, `results`: its members' statuses and the answer's `Retry-After`),
        retrying a 408/429/503 or a connection failure until `deadline` (30 s from now by default), after the
        answer's `Retry-After` where it has one (as the engine's sink waits it; until 2026-12-06 every retry came
        0.2 s later, five times as often as a sink's under a 1-s Retry-After); False (None for a bundle) when it
        never was. `base`: another address than the collector's (a relay)."""
        deadline = deadline or time.monotonic() + 30.0
        while time.monotonic() < deadline:
            try:
                resp = client.post((base or config["url"]) + path, body, {**headers, **kind_headers})
            except (OSError, http.client.HTTPException) as exc:
                report["failures"].append(f"{type(exc).__name__}")
                time.sleep(0.2)
                continue
            if resp.status_code in (200, 202):
                if not results:
                    return True
                members = resp.json()["results"]
                refused = [r for r in members if r["status"] not in (200, 202, 408, 429, 503)]
                if refused:
                    report["failures"].append(f"member {refused[0]['status']}: {str(refused[0].get('detail'))[:160]}")
                return [r["status"] for r in members], retry_after(resp.headers)
            report["failures"].append(f"{resp.status_code}: {resp.text[:120]}")
            if resp.status_code not in (408, 429, 503):
                return None if results else False
            told = retry_after(resp.headers) if resp.status_code in (429, 503) else None
            time.sleep(min(0.2 if told is None else told, max(0.0, deadline - time.monotonic())))
        return None if results else False

    def render(engine: Engine) -> tuple[Rendered, int]:
        now = time.time()
        spans = engine.instance in otlp
        batch, offered = engine.events(last[engine.instance], now, rates, config["batch_events"], spans=spans)
        last[engine.instance] = now
        engine.batches += 1
        return batch, offered

    def queue_spans(rendered: list[tuple[Engine, Rendered, int]]) -> None:
        """The finished requests of the engines that send them as OTLP spans, queued for their exporters
        (`export_spans`); beyond `SPAN_QUEUE` an engine's are dropped, as the span processor drops them."""
        with lock:
            for engine, batch, _ in rendered:
                if engine.instance in otlp and batch.finished:
                    queued = spans[engine.instance]
                    room = max(0, SPAN_QUEUE - len(queued))
                    queued.extend(batch.finished[:room])
                    report["spans_dropped"] += max(0, len(batch.finished) - room)

    def export_spans(client: Http, engine: Engine) -> None:
        """One export of what `engine` queued (its own request, as each vLLM's exporter sends its own)."""
        with lock:
            finished, spans[engine.instance] = spans[engine.instance], []
        if finished:
            ok = post(client, "/v1/traces", otlp_body([(engine, finished)]), {"Content-Type": "application/x-protobuf"})
            account_spans(ok, len(finished))

    def exporter(engine: Engine, phase: float) -> None:
        """An OTLP engine's span exporter: every `SPAN_EXPORT_S` from its own phase until the run ends."""
        with contextlib.closing(Http(timeout_s=60.0)) as client:
            due = phase + SPAN_EXPORT_S
            while due < config["until"]:
                time.sleep(max(0.0, due - time.time()))
                export_spans(client, engine)
                due += SPAN_EXPORT_S

    def account(
        rendered: list[tuple[Engine, Rendered, int]], stored: dict[str, bool], sent: float, done: float
    ) -> None:
        """What each engine offered and what of it was acknowledged (`stored`: by instance; an engine with
        no events has nothing to be refused); each acknowledged batch's lag from its oldest event to `done`,
        split at `sent`."""
        with lock:
            for engine, batch, offered in rendered:
                report["offered"] += offered
                if not stored.get(engine.instance, True):
                    report["unacked"] += len(batch.events)
                    continue
                for kind, n in batch.counts.items():
                    report["acked"][kind] = report["acked"].get(kind, 0) + n
                if batch.first_ts is not None:
                    report["lags"].append(done - batch.first_ts)
                    report["ages_at_send"].append(sent - batch.first_ts)
                    report["answers"].append(done - sent)
                    report["sent_at"].append(sent)
                if batch.hot_ts is not None and engine.instance not in report["first_hot"]:
                    report["first_hot"][engine.instance] = batch.hot_ts
                    report["hot_stored"][engine.instance] = done

    def account_spans(ok: bool, spans: int) -> None:
        with lock:
            if ok:
                report["acked"]["request"] = report["acked"].get("request", 0) + spans
            else:
                report["unacked"] += spans

    def deliver(
        client: Http, pushed: list[tuple[Engine, Rendered]], keys: dict[str, str], *, via: str | None = None
    ) -> tuple[float, dict[str, bool]]:
        """A node's pushes, each under its key: alone (one POST /v1/ingest per engine, `per_node` 1, or to the relay
        at `via`, which forwards it in its next bundle), or one bundle holding each engine's push, each
        acknowledged by its own result (what the node's relay forwards). When the request left (after the bundle
        was encoded), and whether each engine's push was stored."""
        if per_node == 1 or via is not None:
            sent = time.time()
            return sent, {
                e.instance: post(
                    client, "/v1/ingest", b.body(), {"Idempotency-Key": keys[e.instance], **as_json}, base=via
                )
                for e, b in pushed
            }
        sent, deadline = time.time(), time.monotonic() + 30.0
        stored: dict[str, bool] = {}
        waiting = pushed
        while waiting:
            body = bundle.encode([bundle.Member(keys[e.instance], b.body()) for e, b in waiting])
            answer = post(
                client, bundle.PATH, body, {"Content-Type": bundle.MEDIA_TYPE}, results=True, deadline=deadline
            )
            statuses, told = answer or ([], None)
            answered = dict(zip([e.instance for e, _ in waiting], statuses, strict=False))
            stored.update((e.instance, answered.get(e.instance) in (200, 202)) for e, _ in waiting)
            # the members the storage stage did not take go again, and only they, after the answer's Retry-After:
            # each engine's sink retries its own push through the relay, which bundles the retries anew (until
            # 2026-12-06 the whole bundle went again 0.2 s later, its stored members parsed again as duplicates)
            waiting = [(e, b) for e, b in waiting if answered.get(e.instance) in (408, 429, 503)]
            if waiting:
                report["failures"].append(f"member statuses {sorted(set(statuses))}")
                pause = 1.0 if told is None else told
                if time.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
        return sent, stored

    def ship(client: Http, node: list[Engine], *, via: str | None = None) -> None:
        """A node's pushes (`deliver`); its OTLP engines' finished requests queued for their exporters."""
        rendered = [(engine, *render(engine)) for engine in node]
        pushed = [(engine, batch) for engine, batch, _ in rendered if batch.events]
        keys = {engine.instance: f"{engine.instance}-{engine.run_id}-{engine.batches}" for engine, _ in pushed}
        sent, stored = deliver(client, pushed, keys, via=via) if pushed else (time.time(), {})
        account(rendered, stored, sent, time.time())
        queue_spans(rendered)

    def first_contact(client: Http, node: list[Engine]) -> None:
        """The node's first push, one step per engine, before the timed run: the collectors claim each instance and
        run it names (`collector.claims`: a push that creates one is stored alone, counted against the bounds),
        as a fleet's engines did when they first started. Its events count as acknowledged (`lost`), not as the
        run's rate or lag."""
        now = time.time()
        rendered = [(e, e.render(now - 0.001, now, {"step": 1})) for e in node]
        _, stored = deliver(client, rendered, {e.instance: f"{e.instance}-{e.run_id}-first" for e, _ in rendered})
        with lock:
            report["first_contact_acked"] += sum(1 for e, _ in rendered if stored.get(e.instance))
            report["unacked"] += sum(1 for e, _ in rendered if not stored.get(e.instance))

    def worker() -> None:
        """The collectors' capacity (`min_interval_s` 0): take the node shipped longest ago (never one another
        thread holds), ship it, put it back; `threads` pushes in flight."""
        with contextlib.closing(Http(timeout_s=60.0)) as client:
            while time.time() < config["until"]:
                with lock:
                    node = queue.pop(0) if queue else None
                if node is None:
                    time.sleep(0.01)
                    continue
                try:
                    ship(client, node)
                finally:
                    with lock:
                        queue.append(node)

    def paced(node: list[Engine], via: str | None = None) -> None:
        """A fleet's node: its relay ships every `min_interval_s` from its own phase, one push in flight, as
        each engine's sink does (a hot engine ships alone, to the node relay at `via` where one runs). A slow
        answer delays this node's next push, not another node's: until 2026-12-06 the nodes shared a pool of
        `threads` pushes in flight, and a node waiting for a free one put that wait into its events' lag (the
        pool shipped 73% of the engines' pushes a second, the oldest event's age at send p99 2.15 s)."""
        with contextlib.closing(Http(timeout_s=60.0)) as client:
            while (due := last[node[0].instance] + config["min_interval_s"]) < config["until"]:
                time.sleep(max(0.0, due - time.time()))
                ship(client, node, via=via)

    hot_engines = [e for e in engines if e.hot_from is not None]
    others = [e for e in engines if e.hot_from is None]
    queue[:] = [others[i : i + per_node] for i in range(0, len(others), per_node)]
    if config.get("first_contact"):
        began = time.time()
        with contextlib.closing(Http(timeout_s=60.0)) as client, ThreadPoolExecutor(config["threads"]) as pool:
            list(pool.map(lambda node: first_contact(client, node), [*queue, *([e] for e in hot_engines)]))
        report["first_contact_s"] = time.time() - began
    while time.time() < config["start"]:
        time.sleep(0.01)
    begin = time.time()  # a sender that started late has no events from before it ran
    # a fleet's sinks did not all start in the same second: each node's (and hot engine's) interval starts at its
    # own phase, spread evenly over one interval, so they come due one after another rather than all at once (all
    # at `begin`, the first seconds were one burst of every engine: the live run's whole lag tail, 3-4.6 s, and
    # nothing like it after)
    shippers = [*queue, *([e] for e in hot_engines)]
    for k, node in enumerate(shippers):
        phase = begin + config["min_interval_s"] * k / len(shippers)
        last.update((e.instance, phase) for e in node)
    if config["min_interval_s"] > 0:
        threads = [threading.Thread(target=paced, args=(node,)) for node in queue]
    else:
        threads = [threading.Thread(target=worker) for _ in range(config["threads"])]
    threads += [threading.Thread(target=paced, args=([e], config.get("hot_url"))) for e in hot_engines]
    exporting = [e for e in engines if e.instance in otlp]
    threads += [
        threading.Thread(target=exporter, args=(e, begin + SPAN_EXPORT_S * k / len(exporting)))
        for k, e in enumerate(exporting)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # what finished since each exporter's last export: flushed at shutdown
    with contextlib.closing(Http(timeout_s=60.0)) as client:
        for e in exporting:
            export_spans(client, e)
    report["failures"] = report["failures"][:5]
    if sched is not None:
        report["sched"] = sched
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["sender"]:
        print(json.dumps(sender_main(json.loads(sys.argv[2]))))
