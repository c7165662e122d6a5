"""What the HTTP sink lost, kept until the collector has stored a `gap` record of it.

A loss is counted where it happens (a full queue, an evicted spool batch, a batch refused for good) into
one open entry per (event type, reason): counts add up, the time span widens. The sink cuts the open
entries into `GapEvent`s when it can send, and sends them in a batch of their own; what happens to that
batch is the sink's business (it keeps it until delivered). So the memory held is bounded by the number
of (type, reason) pairs however long the collector stays away.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from engine.events import GapEvent

log = logging.getLogger(__name__)

KINDS = ("request", "step", "alloc", "sample")


@dataclass
class _Open:
    events: int
    first_ts: float
    last_ts: float
    instance: str
    run_id: str

    def add(self, other: _Open) -> None:
        self.events += other.events
        self.first_ts = min(self.first_ts, other.first_ts)
        self.last_ts = max(self.last_ts, other.last_ts)
        self.instance, self.run_id = other.instance, other.run_id


def summarize(body: bytes, events: int, now: float) -> dict[str, _Open]:
    """Per event type, what a batch body held (count, time span, the last event's instance and run).

    A body that cannot be read (a damaged spool file) is `events` of type `unknown` at `now`."""
    try:
        data = json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)
        out: dict[str, _Open] = {}
        for event in data["events"]:
            kind = event["type"] if event.get("type") in KINDS else "unknown"
            entry = _Open(1, float(event["ts"]), float(event["ts"]), str(event["instance"]), str(event["run_id"]))
            if kind in out:
                out[kind].add(entry)
            else:
                out[kind] = entry
        return out
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return {"unknown": _Open(events, now, now, "", "")} if events else {}


class GapLedger:
    """Open loss entries per (kind, reason) plus lifetime totals (the engine's /metrics). Thread-safe:
    the engine thread records queue drops, the sink thread everything else."""

    def __init__(self, *, instance: str = "", run_id: str = "") -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], _Open] = {}
        self.totals: Counter[tuple[str, str]] = Counter()
        # Where a loss names no instance (an unreadable spool file): the last one seen.
        self._instance, self._run_id = instance, run_id

    def record(self, kind: str, reason: str, entry: _Open) -> None:
        with self._lock:
            self.totals[(kind, reason)] += entry.events
            if entry.instance:
                self._instance, self._run_id = entry.instance, entry.run_id
            key = (kind, reason)
            if key in self._open:
                self._open[key].add(entry)
            else:
                self._open[key] = entry

    def record_event(self, reason: str, kind: str, ts: float, instance: str, run_id: str) -> None:
        self.record(kind, reason, _Open(1, ts, ts, instance, run_id))

    def record_body(self, reason: str, body: bytes, events: int, now: float) -> None:
        for kind, entry in summarize(body, events, now).items():
            self.record(kind, reason, entry)

    def by_reason(self) -> Counter[str]:
        with self._lock:
            out: Counter[str] = Counter()
            for (_kind, reason), n in self.totals.items():
                out[reason] += n
            return out

    @property
    def pending(self) -> bool:
        return bool(self._open)

    def cut(self, now: float) -> list[GapEvent]:
        """The open entries as gap records stamped `now`; the ledger starts over (empty)."""
        with self._lock:
            taken, self._open = self._open, {}
            fallback = (self._instance, self._run_id)
        out = []
        for (kind, reason), e in sorted(taken.items()):
            instance, run_id = (e.instance, e.run_id) if e.instance else fallback
            if not instance or not run_id:
                log.warning("telemetry: %d lost %s events name no instance; not reported", e.events, kind)
                continue
            try:
                gap = GapEvent(
                    instance=instance,
                    run_id=run_id,
                    ts=max(now, e.last_ts),
                    kind=kind,
                    reason=reason,
                    events=e.events,
                    first_ts=e.first_ts,
                    last_ts=e.last_ts,
                )
            except ValidationError as exc:  # only from a damaged gap file
                log.warning("telemetry: dropping an invalid gap entry (%s, %s): %s", kind, reason, exc)
                continue
            out.append(gap)
        return out

    def put_back(self, gaps: Iterable[GapEvent]) -> None:
        """Undelivered records back into the open entries (at close, to be saved)."""
        for g in gaps:
            entry = _Open(g.events, g.first_ts, g.last_ts, g.instance, g.run_id)
            with self._lock:
                key = (g.kind, g.reason)
                if key in self._open:
                    self._open[key].add(entry)
                else:
                    self._open[key] = entry

    # --- across a restart (spool directories only) ------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the open entries (nothing if none): the next sink on this spool reports them."""
        with self._lock:
            rows = [[k, r, e.events, e.first_ts, e.last_ts, e.instance, e.run_id] for (k, r), e in self._open.items()]
        if not rows:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        """Take over what a previous sink saved (the file is removed: from now on the entries are ours)."""
        try:
            rows = json.loads(path.read_text())
            for kind, reason, events, first_ts, last_ts, instance, run_id in rows:
                entry = _Open(int(events), float(first_ts), float(last_ts), str(instance), str(run_id))
                with self._lock:
                    self._open[(str(kind), str(reason))] = entry
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable gap file %s: %s", path, exc)
        path.unlink(missing_ok=True)
