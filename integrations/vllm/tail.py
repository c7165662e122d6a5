"""`kvpilot collector tail --file vllm.log`: ship the iteration lines of a vLLM that runs elsewhere.

Each iteration line becomes a step event (`integrations.vllm.iteration_log`, placed by the line's own time: to the
microsecond when vLLM ran with `VLLM_LOGGING_PREFIX='%(created).6f '` as `kvpilot vllm serve` sets it,
else to the second) for the engine's HTTP sink, as `kvpilot vllm serve` does for a vLLM it starts.
Steps are placed within each read (a burst of lines is read whole), so none is held across a checkpoint.
How far the file was read is kept in `<spool dir>/<instance>/tail-state.json` (with the run id and what
the log said about the KV capacity) and is written only after the sink has handed every event of the
lines before that offset to the collector or to its disk spool, so a restart resends nothing; a crash
between the two resends at most one checkpoint's lines. A file that shrank below the offset or was
replaced (another inode) is read from its start.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from engine.sinks import EventSink
from integrations.vllm.iteration_log import (
    MAX_LINE_CHARS,
    KvCapacity,
    StepPlacer,
    VllmLogParser,
    VllmLogStats,
    step_event,
)

log = logging.getLogger("kvpilot.vllm")

STATE_FILE = "tail-state.json"
CHUNK_BYTES = 1 << 20
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS  # UTF-8: a character is at most 4 bytes
CHECKPOINT_LINES = 20_000  # also checkpoint inside a long backlog, not only at its end


@dataclass
class TailState:
    file: str
    inode: int
    offset: int
    run_id: str
    capacity_tokens: int | None = None
    block_size: int | None = None

    @classmethod
    def load(cls, path: Path) -> TailState | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring unreadable tail state %s (%s); reading the file from its start", path, exc)
            return None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)), encoding="utf-8")
        os.replace(tmp, path)


class LogTail:
    def __init__(
        self,
        path: Path,
        *,
        instance: str,
        sink: EventSink,
        state_dir: Path,
        run_id: str | None = None,
        block_size: int | None = None,
    ) -> None:
        self.path = path.resolve()
        self.sink = sink
        state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = state_dir / STATE_FILE
        inode = self.path.stat().st_ino
        saved = TailState.load(self.state_path)
        if saved is not None and (saved.file != str(self.path) or saved.inode != inode):
            log.info("%s is not the file tailed before (%s); reading it from its start", self.path, saved.file)
            saved = TailState(file=str(self.path), inode=inode, offset=0, run_id=saved.run_id)
        self.state = saved or TailState(file=str(self.path), inode=inode, offset=0, run_id="")
        self.state.run_id = run_id or self.state.run_id or f"vllm-{uuid.uuid4().hex[:12]}"
        capacity = KvCapacity(tokens=self.state.capacity_tokens, block_size=block_size or self.state.block_size)
        self.parser = VllmLogParser(instance=instance, run_id=self.state.run_id, capacity=capacity, ts_from_log=True)
        self.placer = StepPlacer()
        self._fixed_block_size = block_size
        self._skipping = False  # inside an over-long line, dropping bytes until its newline

    @property
    def stats(self) -> VllmLogStats:
        return self.parser.stats

    def run(self, *, follow: bool, poll_s: float = 0.5, stop: threading.Event | None = None) -> VllmLogStats:
        """Read to the end (and, with `follow`, keep reading until `stop` is set); checkpoint as it goes."""
        stop = stop or threading.Event()
        fh = self._open(self.state.offset)
        try:
            while True:
                self._read_available(fh)
                self._checkpoint()
                if not follow or stop.is_set():
                    return self.stats
                if self._replaced():
                    self._read_available(fh)  # what reached the old file before it was moved away
                    self._checkpoint()
                    fh.close()
                    self._read_from_start()
                    fh = self._open(0)
                    continue
                stop.wait(poll_s)
        finally:
            fh.close()

    def _open(self, offset: int) -> BinaryIO:
        fh = self.path.open("rb")
        size = os.fstat(fh.fileno()).st_size
        if offset > size:
            log.info("%s shrank below the saved offset; reading it from its start", self.path)
            offset = 0
        self.state.offset = offset
        fh.seek(offset)
        return fh

    def _replaced(self) -> bool:
        try:
            st = self.path.stat()
        except FileNotFoundError:  # rotated away, the new one not created yet
            return False
        return st.st_ino != self.state.inode or st.st_size < self.state.offset

    def _read_from_start(self) -> None:
        self.state.inode = self.path.stat().st_ino
        self.state.offset = 0
        self._skipping = False
        log.info("%s was replaced or truncated; reading it from its start", self.path)

    def _read_available(self, fh: BinaryIO) -> None:
        pending = b""
        since_checkpoint = 0
        while chunk := fh.read(CHUNK_BYTES):
            buf = pending + chunk
            start = 0
            while (nl := buf.find(b"\n", start)) >= 0:
                self._line(buf[start:nl])
                start = nl + 1
                since_checkpoint += 1
            self.state.offset += start
            pending = buf[start:]
            if len(pending) > MAX_LINE_BYTES:  # no newline in sight: parse the head, drop the rest of the line
                if not self._skipping:
                    self._line(pending[:MAX_LINE_BYTES])
                    self._skipping = True
                self.state.offset += len(pending)
                pending = b""
            if since_checkpoint >= CHECKPOINT_LINES:
                self._checkpoint()
                since_checkpoint = 0
        fh.seek(self.state.offset)  # an unfinished last line is read again, whole, next time

    def _line(self, raw: bytes) -> None:
        if self._skipping:  # the tail of a line already cut
            self._skipping = False
            return
        step = self.parser.feed(raw.decode("utf-8", errors="replace").rstrip("\r"))
        if step is not None:
            for placed in self.placer.push(step):
                self.sink.emit(step_event(placed))

    def _checkpoint(self) -> None:
        for placed in self.placer.flush():
            self.sink.emit(step_event(placed))
        self.sink.flush()
        if getattr(self.sink, "queued", 0):  # not all handed over yet: keep the old offset
            return
        capacity = self.parser.capacity
        self.state.capacity_tokens = capacity.tokens
        self.state.block_size = self._fixed_block_size or capacity.block_size
        self.state.save(self.state_path)


def tail_file(
    path: Path,
    *,
    instance: str,
    sink_factory: Callable[[Path], EventSink],
    state_dir: Path,
    follow: bool,
    run_id: str | None = None,
    block_size: int | None = None,
    stop: threading.Event | None = None,
    poll_s: float = 0.5,
) -> tuple[VllmLogStats, EventSink]:
    """Tail `path` into a sink made for `state_dir` (the instance's spool directory); close the sink after."""
    sink = sink_factory(state_dir)
    try:
        tail = LogTail(path, instance=instance, sink=sink, state_dir=state_dir, run_id=run_id, block_size=block_size)
        stats = tail.run(follow=follow, stop=stop, poll_s=poll_s)
    finally:
        sink.close()
    return stats, sink
