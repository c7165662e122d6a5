"""Where telemetry events go. The engine hands typed events to an `EventSink` and never waits on it.

Sinks are injected: tests use `MemorySink`, `kvpilot engine serve` picks one from
`TelemetryConfig.sink`; the HTTP sink that pushes to the collector lives in `engine.http_sink`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from engine.events import AllocEvent, RequestEvent, SampleEvent, StepEvent, event_to_json

AnyEvent = RequestEvent | StepEvent | AllocEvent | SampleEvent


@runtime_checkable
class EventSink(Protocol):
    def emit(self, event: AnyEvent) -> None:
        """Accept one event; must not block the engine loop."""

    def flush(self) -> None:
        """Push out anything buffered (best effort)."""

    def close(self) -> None:
        """Flush and release resources; emit() after close() is ignored."""


class NullSink:
    """Telemetry off: the baseline the overhead benchmark compares against."""

    def emit(self, event: AnyEvent) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class MemorySink:
    """Keeps every event in a list; thread-safe so the server thread can read while the loop writes."""

    def __init__(self) -> None:
        self._events: list[AnyEvent] = []
        self._lock = threading.Lock()

    def emit(self, event: AnyEvent) -> None:
        with self._lock:
            self._events.append(event)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def events(self) -> list[AnyEvent]:
        with self._lock:
            return list(self._events)

    def of_type(self, kind: str) -> list[AnyEvent]:
        return [e for e in self.events if e.type == kind]

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


class JsonlSink:
    """One JSON object per line, appended; the file is what `kvpilot collector import` would read."""

    def __init__(self, path: str | Path, flush_every: int = 256) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self._pending = 0
        self._flush_every = flush_every
        self._lock = threading.Lock()
        self._closed = False

    def emit(self, event: AnyEvent) -> None:
        line = json.dumps(event_to_json(event), separators=(",", ":"))
        with self._lock:
            if self._closed:
                return
            self._fh.write(line + "\n")
            self._pending += 1
            if self._pending >= self._flush_every:
                self._fh.flush()
                self._pending = 0

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._fh.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._fh.flush()
                self._fh.close()
                self._closed = True


class FanoutSink:
    """Sends each event to several sinks (e.g. the collector and a local JSONL file)."""

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, event: AnyEvent) -> None:
        for sink in self.sinks:
            sink.emit(event)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
