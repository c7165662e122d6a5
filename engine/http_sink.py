"""The engine's HTTP sink: pushes events to the collector without ever blocking the engine loop.

`emit()` appends to a bounded in-memory queue (O(1); when the queue is full the event is dropped and
counted). A background thread cuts batches by size (`batch_size`) or time (`flush_interval_s`),
serializes them in pydantic-core and POSTs them with an `Idempotency-Key` that stays the same on every
retry, so the collector stores a retried batch once. A gauge sample (`flush_on_sample`, on by default)
cuts the batch at once: the queue depth or KV usage a rule pages on leaves when it is taken, not up to a
flush interval later; the engine samples once a second, so the pushes stay about one a second, in step
with the samples. Samples faster than a quarter of `flush_interval_s` wait for the timer (a burst of
them is not a burst of pushes).

While the collector is unreachable (connection error, timeout, 408/425/5xx) batches go to the spool
(`engine.spool`: a directory of one file per batch, bounded by `spool_max_bytes`). When it is full the
OLDEST batches are dropped: for live monitoring the newest data matters most. Once a send succeeds again
the spool drains oldest first, before any newer batch, so events arrive in order; it survives a restart.
Retries back off (capped at `backoff_max_s`), but while the collector is unreachable the sink also asks
its /health every `probe_interval_s` and drains as soon as it answers. A 429/503 with `Retry-After` is
obeyed instead: the collector is up and said when to come back.

401/403 (a wrong ingest token) is not an outage: after `auth_max_tries` refusals in a row the sink stops
sending, says so in an ERROR log line and `kvpilot_telemetry_unauthorized`, and keeps spooling (bounded)
for a restart with the right token, or for a new token in `token_file` (`engine.token_source`: re-read
when it changes, which is how an engine follows a rotation of its secret). Batches the collector refuses
for good (413/422/409) are dropped and counted as `rejected`, with an ERROR line (a 409 names the fix: the
instance belongs to another identity). Without a spool directory the spool is kept in memory, with the
same bound.

Every loss is counted by event type and reason (`queue_full`, `spool_full`, `unauthorized`, `rejected`,
`shutdown`) in `engine.gaps.GapLedger`, and the collector is told: `gap` records go in a batch of their
own ahead of the spool, one per (type, reason), kept (counts accumulating) until the collector stored
them, and saved in the spool directory at close.
"""

from __future__ import annotations

import collections
import gzip
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import httpx
from prometheus_client import CollectorRegistry
from pydantic import TypeAdapter

from engine.events import Event, GapEvent
from engine.gaps import GapLedger
from engine.sink_metrics import SinkMetrics
from engine.sinks import AnyEvent
from engine.spool import (  # noqa: F401 - re-exported: engine.http_sink was their home
    DiskSpool,
    MemorySpool,
    Spool,
    SpooledBatch,
    SpoolLockedError,
    spool_dir_for,
)
from engine.token_source import TokenSource

log = logging.getLogger(__name__)

_events_adapter: TypeAdapter[list[Event]] = TypeAdapter(list[Event])

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
AUTH_STATUS = frozenset({401, 403})
GAP_FILE = "gaps.json"


class HttpSink:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_file: str | os.PathLike | None = None,
        batch_size: int = 1000,
        flush_interval_s: float = 1.0,
        queue_size: int = 100_000,
        spool_dir: str | os.PathLike | None = None,
        spool_max_bytes: int = 256 * 2**20,
        timeout_s: float = 5.0,
        compress: bool = True,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        probe_interval_s: float = 1.0,
        retry_after_max_s: float = 60.0,
        auth_max_tries: int = 3,
        flush_on_sample: bool = True,
        registry: CollectorRegistry | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        if batch_size < 1 or queue_size < 1 or auth_max_tries < 1:
            raise ValueError("batch_size, queue_size and auth_max_tries must be positive")
        self.url = url.rstrip("/")
        self.endpoint = self.url + "/v1/ingest"
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.flush_on_sample = flush_on_sample
        self._last_cut = 0.0  # monotonic: when the sink thread last cut a batch (a sample's early cut is bounded)
        self.queue_size = queue_size
        self.compress = compress
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.probe_interval_s = probe_interval_s
        self.retry_after_max_s = retry_after_max_s
        self.auth_max_tries = auth_max_tries
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        self._token = TokenSource(token, token_file)
        self._sent_token: str | None = None
        self._refused_token: str | None = None
        if compress:
            self._headers["Content-Encoding"] = "gzip"
        self._client = client or httpx.Client(timeout=timeout_s)
        self.spool: Spool = DiskSpool(spool_dir, spool_max_bytes) if spool_dir else MemorySpool(spool_max_bytes)
        self.ledger = GapLedger()
        if isinstance(self.spool, DiskSpool):
            self.ledger.load(self.spool.dir / GAP_FILE)

        self.sent = 0
        self.spooled = 0
        self.retries = 0
        self.auth_failures = 0
        self.gaps_sent = 0
        self.stopped = False  # the collector refused the token auth_max_tries times in a row
        self._auth_streak = 0
        self._gap_batch: tuple[SpooledBatch, list[GapEvent]] | None = None  # sent, not yet acknowledged
        self._maybe_stored = False  # the last failed send may have been stored (a timeout after connecting)

        self._queue: collections.deque[AnyEvent] = collections.deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._closed = False
        self._next_attempt = 0.0
        self._next_probe: float | None = None  # set while the collector is unreachable
        self._backoff = backoff_initial_s
        self._thread = threading.Thread(target=self._run, name="kvpilot-http-sink", daemon=True)
        self._thread.start()
        if registry is not None:
            registry.register(SinkMetrics(self))

    @classmethod
    def from_config(cls, telemetry, registry: CollectorRegistry | None = None) -> HttpSink:
        """Build from `engine.config.TelemetryConfig`."""
        return cls(
            telemetry.collector_url,
            token=telemetry.collector_token,
            token_file=telemetry.collector_token_file,
            batch_size=telemetry.http_batch_size,
            flush_interval_s=telemetry.http_flush_interval_s,
            queue_size=telemetry.http_queue_size,
            spool_dir=spool_dir_for(telemetry.spool_dir, telemetry.instance) if telemetry.spool_dir else None,
            spool_max_bytes=telemetry.spool_max_bytes,
            compress=telemetry.http_compress,
            flush_on_sample=telemetry.http_flush_on_sample,
            registry=registry,
        )

    # --- the engine side: O(1), never blocks --------------------------------------------------------

    def emit(self, event: AnyEvent) -> None:
        if self._closed:
            return
        if len(self._queue) >= self.queue_size:
            self.ledger.record_event("queue_full", event.type, event.ts, event.instance, event.run_id)
            return
        self._queue.append(event)
        if len(self._queue) >= self.batch_size or (
            self.flush_on_sample
            and event.type == "sample"
            and time.monotonic() - self._last_cut >= self.flush_interval_s / 4
        ):
            self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every queued event was sent or spooled."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._thread.is_alive():
            if not self._queue and self._idle.is_set():
                return
            self._idle.clear()
            self._wake.set()
            self._idle.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))

    def wait_drained(self, timeout_s: float = 30.0) -> bool:
        """Wait until the queue, the spool and the loss records are all delivered (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._queue and not len(self.spool) and not self.gaps_pending and self._idle.is_set():
                return True
            self._wake.set()
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s + 1)
        if isinstance(self.spool, MemorySpool) and len(self.spool):
            lost = 0
            while (batch := self.spool.peek()) is not None:
                lost += batch.events
                self.ledger.record_body("shutdown", batch.body, batch.events, time.time())
                self.spool.remove(batch)
            log.warning("telemetry: %d unsent events lost at close (no spool_dir configured)", lost)
        if self._gap_batch is not None:
            self.ledger.put_back(self._gap_batch[1])
            self._gap_batch = None
        if isinstance(self.spool, DiskSpool):
            self.ledger.save(self.spool.dir / GAP_FILE)  # the next sink on this spool reports them
            self.spool.close()
        self._client.close()

    # --- counters ------------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        return sum(self.ledger.by_reason().values())

    @property
    def rejected(self) -> int:
        return self.ledger.by_reason()["rejected"]

    def dropped_by_reason(self) -> dict[str, int]:
        by_reason = self.ledger.by_reason()
        return {r: by_reason[r] for r in ("queue_full", "spool_full", "unauthorized", "rejected", "shutdown")}

    @property
    def gaps_pending(self) -> bool:
        return self._gap_batch is not None or self.ledger.pending

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def spool_bytes(self) -> int:
        return self.spool.bytes

    # --- background thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=self._wait_s())
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                self._probe()
                if self._send_gaps():
                    self._drain_spool()
                while self._queue:
                    self._idle.clear()
                    self._ship(self._cut_batch())
            except Exception:  # the sink must never die silently; keep serving and log
                log.exception("telemetry sink iteration failed")
            if not self._queue:
                self._idle.set()
            if stopping:
                return

    def _wait_s(self) -> float:
        """Until the next batch is due, or sooner: the next health probe or retry while data waits."""
        wait = self.flush_interval_s
        if self.stopped or not (len(self.spool) or self.gaps_pending):
            return wait
        now = time.monotonic()
        for due in (self._next_probe, self._next_attempt):
            if due is not None and due > now:
                wait = min(wait, due - now)
        return max(wait, 0.005)

    def _cut_batch(self) -> list[AnyEvent]:
        self._last_cut = time.monotonic()
        batch = []
        queue = self._queue
        for _ in range(min(self.batch_size, len(queue))):
            batch.append(queue.popleft())
        return batch

    def _encode(self, key: str, events: Sequence[AnyEvent | GapEvent]) -> bytes:
        body = b'{"idempotency_key":"' + key.encode() + b'","events":' + _events_adapter.dump_json(list(events)) + b"}"
        return gzip.compress(body, compresslevel=1) if self.compress else body

    def _may_send(self) -> bool:
        if self.stopped and self._token.current() != self._refused_token:
            log.warning("telemetry: the collector token changed; sending resumes")
            self.stopped, self._auth_streak, self._next_attempt = False, 0, 0.0
        return not self.stopped and time.monotonic() >= self._next_attempt

    def _ship(self, events: list[AnyEvent]) -> None:
        key = uuid.uuid4().hex
        batch = SpooledBatch(ident=key, key=key, events=len(events), body=self._encode(key, events))
        if len(self.spool) or not self._may_send():
            self._to_spool(batch)  # keep order: older spooled batches go first
            return
        outcome = self._send(batch)
        if outcome == "retry":
            self._to_spool(batch)

    def _to_spool(self, batch: SpooledBatch) -> None:
        evicted = self.spool.push(batch)
        self.spooled += batch.events
        reason = "unauthorized" if self._auth_streak else "spool_full"
        now = time.time()
        for old in evicted:
            self.ledger.record_body(reason, old.body, old.events, now)
        if evicted:
            log.warning("telemetry spool full: dropped %d oldest batches (%s)", len(evicted), reason)

    def _send_gaps(self) -> bool:
        """Deliver the loss records first (a batch of their own, the same key until stored); False: wait."""
        if not self.gaps_pending:
            return True
        if not self._may_send():
            return False
        if self._gap_batch is None:
            gaps = self.ledger.cut(time.time())
            if not gaps:
                return True
            key = uuid.uuid4().hex
            self._gap_batch = (SpooledBatch(key, key, len(gaps), self._encode(key, gaps)), gaps)
        batch, gaps = self._gap_batch
        outcome = self._send(batch, gap=True)
        if outcome == "retry":
            if not self._maybe_stored:  # surely not stored: back into the open entries, one record each
                self.ledger.put_back(gaps)
                self._gap_batch = None
            return False
        if outcome == "ok":
            self.gaps_sent += len(gaps)
        self._gap_batch = None
        return True

    def _drain_spool(self) -> None:
        while len(self.spool) and self._may_send():
            batch = self.spool.peek()
            if batch is None:
                return
            self.retries += 1
            outcome = self._send(batch)
            if outcome == "retry":
                return
            self.spool.remove(batch)

    def _send(self, batch: SpooledBatch, *, gap: bool = False) -> str:
        """POST one batch: 'ok', 'rejected' (permanent) or 'retry' (and schedule the next attempt)."""
        headers = {**self._headers, "Idempotency-Key": batch.key}
        self._sent_token = self._token.current()
        if self._sent_token:
            headers["Authorization"] = f"Bearer {self._sent_token}"
        self._maybe_stored = False
        try:
            resp = self._client.post(self.endpoint, content=batch.body, headers=headers)
        except httpx.HTTPError as exc:
            # Past the connect, the collector may have stored it: only the same key may retry it then.
            self._maybe_stored = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
            return self._failed(f"{type(exc).__name__}: {exc}", probe=True)
        status = resp.status_code
        if status < 300:
            if not gap:
                self.sent += batch.events
            self._backoff = self.backoff_initial_s
            self._next_attempt = 0.0
            self._next_probe = None
            self._auth_streak = 0
            return "ok"
        if status in AUTH_STATUS:
            return self._unauthorized(status)
        if status in RETRYABLE_STATUS:
            wait = retry_after(resp.headers) if status in (429, 503) else None
            if wait is not None:
                return self._told_to_wait(status, min(wait, self.retry_after_max_s))
            return self._failed(f"HTTP {status}: {resp.text[:200]}", probe=status in (502, 503, 504))
        if gap:  # a collector older than the `gap` record; the data still goes
            log.error("collector %s refused the gap records (HTTP %d): losses are on /metrics only", self.url, status)
            return "rejected"
        self.ledger.record_body("rejected", batch.body, batch.events, time.time())
        hint = (
            " (the instance belongs to another identity: use this identity's own instance name, or have an admin"
            " run `kvpilot collector tokens reassign`)"
            if status == 409
            else ""
        )
        log.error(
            "collector refused a batch of %d events for good (HTTP %d)%s: %s",
            batch.events,
            status,
            hint,
            resp.text[:500],
        )
        return "rejected"

    def _failed(self, why: str, *, probe: bool) -> str:
        delay = self._backoff * (0.5 + random.random())
        now = time.monotonic()
        self._next_attempt = now + delay
        self._backoff = min(self._backoff * 2, self.backoff_max_s)
        if probe and self._next_probe is None:
            self._next_probe = now + self.probe_interval_s
        log.warning("collector unreachable (%s); spooling, next try in %.2fs", why, delay)
        return "retry"

    def _told_to_wait(self, status: int, wait_s: float) -> str:
        self._next_attempt = time.monotonic() + wait_s
        self._next_probe = None  # it is up: no probe may cut the wait short
        log.warning("collector overloaded (HTTP %d); spooling, retrying after %.1fs as it asked", status, wait_s)
        return "retry"

    def _unauthorized(self, status: int) -> str:
        self._refused_token = self._sent_token
        self.auth_failures += 1
        self._auth_streak += 1
        self._next_probe = None  # /health cannot tell whether a token is right
        if self._auth_streak >= self.auth_max_tries:
            self.stopped = True
            log.error(
                "collector %s refused the ingest token (HTTP %d) %d times in a row: telemetry sending STOPPED."
                " Events stay in the spool (bounded: the oldest are dropped as 'unauthorized') until the engine"
                " restarts with the right telemetry.collector_token",
                self.url,
                status,
                self._auth_streak,
            )
            return "retry"
        return self._failed(f"HTTP {status}: the collector refused the ingest token", probe=False)

    def _probe(self) -> None:
        """While the collector is unreachable: ask its /health; when it answers, retry at once."""
        now = time.monotonic()
        if self._next_probe is None or now < self._next_probe or self.stopped:
            return
        if not (len(self.spool) or self.gaps_pending):
            self._next_probe = None  # nothing waits: the next batch finds out by itself
            return
        try:
            ok = self._client.get(self.url + "/health", timeout=min(self.timeout_s, 2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self._next_attempt = 0.0
            self._backoff = self.backoff_initial_s
            self._next_probe = None
        else:
            self._next_probe = time.monotonic() + self.probe_interval_s


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from an answer's `Retry-After: <seconds>` header (the collector's form; `headers` looked up by the
    lowercase name, as httpx's are), None without a usable one."""
    try:
        value = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None
