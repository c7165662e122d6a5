"""The HTTP sink's spool: batches waiting for the collector, oldest first, bounded in bytes.

`MemorySpool` keeps them in memory; `DiskSpool` keeps one file per batch in a directory of its own (one
sink per directory, held with a lock), so what is left survives a restart. Both evict the OLDEST batches
to stay within `max_bytes` and hand them back (with their bodies), so the sink can say what it lost.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


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
        """Store a batch; returns the batches evicted (oldest first, bodies included) to stay within the bound."""

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
            try:  # the body says what was lost (event types, time span)
                body = path.read_bytes()
            except OSError:
                body = b""
            path.unlink(missing_ok=True)
            evicted.append(SpooledBatch(path.name, key, events, body))
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
