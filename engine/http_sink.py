"""The engine's HTTP sink: pushes events to the collector without ever blocking the engine loop.

`emit()` appends to a bounded in-memory queue (O(1); when the queue is full the event is dropped and
counted). A background thread cuts batches by size (`batch_size`) or time (`flush_interval_s`),
serializes them in pydantic-core and POSTs them with an `Idempotency-Key` that stays the same on every
retry, so the collector stores a retried batch once.

While the collector is unreachable (connection error, timeout, 408/429/5xx, 401/403) batches go to a
spool, a directory of one file per batch, bounded by `spool_max_bytes`. When the spool is full the
OLDEST batches are dropped (and counted): for live monitoring the newest data matters most, and an
engine that has been cut off long enough to fill the spool has already lost the history's value.
Once a send succeeds again the spool drains oldest first, before any newer batch is sent, so events
arrive in order. The spool survives a restart: a new sink on the same directory drains what is left.
Batches the collector refuses for good (413/422/409) are dropped with a log line and counted as
`rejected`. Without a spool directory the spool is kept in memory, with the same bound.
"""

from __future__ import annotations

import collections
import fcntl
import gzip
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import TypeAdapter

from collector.events import Event
from engine.sinks import AnyEvent

log = logging.getLogger(__name__)

_events_adapter: TypeAdapter[list[Event]] = TypeAdapter(list[Event])

RETRYABLE_STATUS = frozenset({401, 403, 408, 425, 429, 500, 502, 503, 504})


class SpoolLockedError(RuntimeError):
    """Another live sink owns this spool directory."""


@dataclass(frozen=True)
class SpooledBatch:
    ident: str
    key: str
    events: int
    body: bytes


class Spool(Protocol):
    def push(self, batch: SpooledBatch) -> list[SpooledBatch]:
        """Store a batch; returns the batches evicted (oldest first) to stay within the bound."""

    def peek(self) -> SpooledBatch | None: ...

    def remove(self, batch: SpooledBatch) -> None: ...

    def __len__(self) -> int: ...

    @property
    def bytes(self) -> int: ...


class MemorySpool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._batches: collections.deque[SpooledBatch] = collections.deque()
        self._bytes = 0

    def push(self, batch: SpooledBatch) -> list[SpooledBatch]:
        evicted = []
        while self._batches and self._bytes + len(batch.body) > self.max_bytes:
            old = self._batches.popleft()
            self._bytes -= len(old.body)
            evicted.append(old)
        if len(batch.body) > self.max_bytes:
            return [*evicted, batch]
        self._batches.append(batch)
        self._bytes += len(batch.body)
        return evicted

    def peek(self) -> SpooledBatch | None:
        return self._batches[0] if self._batches else None

    def remove(self, batch: SpooledBatch) -> None:
        if self._batches and self._batches[0].ident == batch.ident:
            self._batches.popleft()
            self._bytes -= len(batch.body)

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def bytes(self) -> int:
        return self._bytes


class DiskSpool:
    """One file per batch, `<seq>-<events>-<key>.batch`; written to a temp name, fsynced, renamed."""

    SUFFIX = ".batch"

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        # One sink per directory: two draining one spool would race on its files.
        self._lock_fh = (self.dir / ".lock").open("a")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.close()
            raise SpoolLockedError(
                f"spool {self.dir} is in use by another sink; give each engine its own telemetry.spool_dir"
            ) from None
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        self._files: collections.deque[tuple[Path, int, str, int]] = collections.deque()
        for path in sorted(self.dir.glob(f"*{self.SUFFIX}")):
            parsed = self._parse(path)
            if parsed is None:
                log.warning("ignoring unexpected spool file %s", path)
                continue
            self._files.append(parsed)
        self._bytes = sum(f[3] for f in self._files)
        self._seq = max((int(f[0].name.split("-", 1)[0]) for f in self._files), default=0)

    @classmethod
    def _parse(cls, path: Path) -> tuple[Path, int, str, int] | None:
        parts = path.name[: -len(cls.SUFFIX)].split("-", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return path, int(parts[1]), parts[2], path.stat().st_size

    def push(self, batch: SpooledBatch) -> list[SpooledBatch]:
        evicted = []
        size = len(batch.body)
        while self._files and self._bytes + size > self.max_bytes:
            path, events, key, fsize = self._files.popleft()
            self._bytes -= fsize
            path.unlink(missing_ok=True)
            evicted.append(SpooledBatch(path.name, key, events, b""))
        if size > self.max_bytes:
            return [*evicted, batch]
        self._seq += 1
        path = self.dir / f"{self._seq:016d}-{batch.events}-{batch.key}{self.SUFFIX}"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            fh.write(batch.body)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.rename(path)
        self._files.append((path, batch.events, batch.key, size))
        self._bytes += size
        return evicted

    def close(self) -> None:
        """Release the directory (files stay for the next sink on it)."""
        if not self._lock_fh.closed:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()

    def peek(self) -> SpooledBatch | None:
        while self._files:
            path, events, key, _size = self._files[0]
            try:
                return SpooledBatch(path.name, key, events, path.read_bytes())
            except FileNotFoundError:
                self._files.popleft()
        return None

    def remove(self, batch: SpooledBatch) -> None:
        if self._files and self._files[0][0].name == batch.ident:
            path, _events, _key, size = self._files.popleft()
            self._bytes -= size
            path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._files)

    @property
    def bytes(self) -> int:
        return self._bytes


def _safe_name(name: str) -> str:
    """An instance label as a directory name (each engine spools into its own subdirectory)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip(".") or "engine"


def spool_dir_for(root: str | os.PathLike, instance: str) -> Path:
    """The spool directory of one instance under `root` (a sink per directory: see DiskSpool)."""
    return Path(root) / _safe_name(instance)


class _SinkCollector:
    """Exposes the sink's plain counters to a prometheus registry (no double bookkeeping)."""

    def __init__(self, sink: HttpSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.sink
        yield CounterMetricFamily("kvpilot_telemetry_events_sent", "events acknowledged by the collector", s.sent)
        yield CounterMetricFamily("kvpilot_telemetry_events_spooled", "events written to the spool", s.spooled)
        dropped = CounterMetricFamily(
            "kvpilot_telemetry_events_dropped", "events lost before the collector stored them", labels=["reason"]
        )
        for reason, n in s.dropped_by_reason().items():
            dropped.add_metric([reason], n)
        yield dropped
        yield CounterMetricFamily("kvpilot_telemetry_send_retries", "batch sends that were retries", s.retries)
        yield GaugeMetricFamily("kvpilot_telemetry_queue_events", "events waiting in memory", s.queued)
        yield GaugeMetricFamily("kvpilot_telemetry_spool_bytes", "bytes waiting in the spool", s.spool_bytes)


class HttpSink:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        batch_size: int = 1000,
        flush_interval_s: float = 1.0,
        queue_size: int = 100_000,
        spool_dir: str | os.PathLike | None = None,
        spool_max_bytes: int = 256 * 2**20,
        timeout_s: float = 5.0,
        compress: bool = True,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        registry: CollectorRegistry | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        if batch_size < 1 or queue_size < 1:
            raise ValueError("batch_size and queue_size must be positive")
        self.endpoint = url.rstrip("/") + "/v1/ingest"
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.queue_size = queue_size
        self.compress = compress
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        if compress:
            self._headers["Content-Encoding"] = "gzip"
        self._client = client or httpx.Client(timeout=timeout_s)
        self.spool: Spool = DiskSpool(spool_dir, spool_max_bytes) if spool_dir else MemorySpool(spool_max_bytes)

        self.sent = 0
        self.spooled = 0
        self.retries = 0
        self.rejected = 0
        self._dropped_queue_full = 0
        self._dropped_spool_full = 0
        self._dropped_shutdown = 0

        self._queue: collections.deque[AnyEvent] = collections.deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._closed = False
        self._next_attempt = 0.0
        self._backoff = backoff_initial_s
        self._thread = threading.Thread(target=self._run, name="kvpilot-http-sink", daemon=True)
        self._thread.start()
        if registry is not None:
            registry.register(_SinkCollector(self))  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, telemetry, registry: CollectorRegistry | None = None) -> HttpSink:  # type: ignore[no-untyped-def]
        """Build from `engine.config.TelemetryConfig`."""
        return cls(
            telemetry.collector_url,
            token=telemetry.collector_token,
            batch_size=telemetry.http_batch_size,
            flush_interval_s=telemetry.http_flush_interval_s,
            queue_size=telemetry.http_queue_size,
            spool_dir=spool_dir_for(telemetry.spool_dir, telemetry.instance) if telemetry.spool_dir else None,
            spool_max_bytes=telemetry.spool_max_bytes,
            compress=telemetry.http_compress,
            registry=registry,
        )

    # --- the engine side: O(1), never blocks --------------------------------------------------------

    def emit(self, event: AnyEvent) -> None:
        if self._closed:
            return
        if len(self._queue) >= self.queue_size:
            self._dropped_queue_full += 1
            return
        self._queue.append(event)
        if len(self._queue) >= self.batch_size:
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
        """Wait until the queue and the spool are both empty (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._queue and not len(self.spool) and self._idle.is_set():
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
                self.spool.remove(batch)
            self._dropped_shutdown += lost
            log.warning("telemetry: %d unsent events lost at close (no spool_dir configured)", lost)
        if isinstance(self.spool, DiskSpool):
            self.spool.close()
        self._client.close()

    # --- counters ------------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        return self._dropped_queue_full + self._dropped_spool_full + self._dropped_shutdown + self.rejected

    def dropped_by_reason(self) -> dict[str, int]:
        return {
            "queue_full": self._dropped_queue_full,
            "spool_full": self._dropped_spool_full,
            "rejected": self.rejected,
            "shutdown": self._dropped_shutdown,
        }

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def spool_bytes(self) -> int:
        return self.spool.bytes

    # --- background thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=self.flush_interval_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
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

    def _cut_batch(self) -> list[AnyEvent]:
        batch = []
        queue = self._queue
        for _ in range(min(self.batch_size, len(queue))):
            batch.append(queue.popleft())
        return batch

    def _encode(self, key: str, events: list[AnyEvent]) -> bytes:
        body = b'{"idempotency_key":"' + key.encode() + b'","events":' + _events_adapter.dump_json(events) + b"}"
        return gzip.compress(body, compresslevel=1) if self.compress else body

    def _ship(self, events: list[AnyEvent]) -> None:
        key = uuid.uuid4().hex
        batch = SpooledBatch(ident=key, key=key, events=len(events), body=self._encode(key, events))
        if len(self.spool) or time.monotonic() < self._next_attempt:
            self._to_spool(batch)  # keep order: older spooled batches go first
            return
        outcome = self._send(batch)
        if outcome == "retry":
            self._to_spool(batch)

    def _to_spool(self, batch: SpooledBatch) -> None:
        evicted = self.spool.push(batch)
        self.spooled += batch.events
        for old in evicted:
            self._dropped_spool_full += old.events
        if evicted:
            log.warning("telemetry spool full: dropped %d oldest batches", len(evicted))

    def _drain_spool(self) -> None:
        while len(self.spool) and time.monotonic() >= self._next_attempt:
            batch = self.spool.peek()
            if batch is None:
                return
            self.retries += 1
            outcome = self._send(batch)
            if outcome == "retry":
                return
            self.spool.remove(batch)

    def _send(self, batch: SpooledBatch) -> str:
        """POST one batch: 'ok', 'rejected' (permanent) or 'retry' (and schedule the backoff)."""
        headers = {**self._headers, "Idempotency-Key": batch.key}
        try:
            resp = self._client.post(self.endpoint, content=batch.body, headers=headers)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}")
        if resp.status_code < 300:
            self.sent += batch.events
            self._backoff = self.backoff_initial_s
            self._next_attempt = 0.0
            return "ok"
        if resp.status_code in RETRYABLE_STATUS:
            return self._failed(f"HTTP {resp.status_code}: {resp.text[:200]}")
        self.rejected += batch.events
        log.error(
            "collector refused a batch of %d events for good (HTTP %d): %s",
            batch.events,
            resp.status_code,
            resp.text[:500],
        )
        return "rejected"

    def _failed(self, why: str) -> str:
        delay = self._backoff * (0.5 + random.random())
        self._next_attempt = time.monotonic() + delay
        self._backoff = min(self._backoff * 2, self.backoff_max_s)
        log.warning("collector unreachable (%s); spooling, next try in %.2fs", why, delay)
        return "retry"
