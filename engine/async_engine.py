"""The serving loop: one thread owns the `LLMEngine`; asyncio handlers talk to it through an inbox.

Handlers submit work (new requests, aborts, config patches) to a thread-safe inbox and await results
on per-request asyncio queues; the loop thread drains the inbox between steps, so the engine itself
stays single-threaded. Admission errors (queue full, invalid request) come back on the request's
future before any token, which the server turns into 429/400.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import SamplingParams, Sequence

log = logging.getLogger("kvpilot.engine.loop")


@dataclass(slots=True)
class RequestHandle:
    """What a handler holds for one request: token batches arrive on `tokens`, `None` ends the stream."""

    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None

    @property
    def admitted_seq(self) -> Sequence:
        """The engine's sequence, set before submit() returns the handle."""
        if self.seq is None:
            raise RuntimeError("the request is not admitted yet")
        return self.seq

    async def stream(self) -> AsyncIterator[list[int]]:
        while True:
            item = await self.tokens.get()
            if item is None:
                return
            yield item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[int, RequestHandle] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.idle_wait_s = idle_wait_s
        self.loop_errors = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.sink.flush()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ handler side
    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, priority: str | int, request_id: str | None = None
    ) -> RequestHandle:
        """Queue a request; raises QueueFullError / InvalidRequestError if it is not admitted.

        The arrival is stamped here, in the HTTP handler, so the time the request waits in the inbox while
        a step runs counts in its queue time and TTFT: what its user waited, not what the engine saw.
        """
        loop = asyncio.get_running_loop()
        handle = RequestHandle(loop, loop.create_future())
        arrival = self.engine.clock.now()
        self._put("add", (handle, prompt_ids, params, priority, request_id, arrival))
        await handle.admitted
        return handle

    def abort(self, request_id: str) -> None:
        self._put("abort", request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps (config reloads, snapshots)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._put("call", (loop, fut, fn))
        return await fut

    def _put(self, kind: str, payload: Any) -> None:
        if not self.alive:
            raise RuntimeError("engine loop is not running")
        self._inbox.put((kind, payload))
        self._wake.set()

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_inbox()
            if not engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                engine.events.maybe_sample(queue_depth=0, running=0)
                continue
            try:
                outputs = engine.step()
            except Exception:
                self.loop_errors += 1
                log.exception("engine step failed; failing the running requests")
                self._fail_all()
                continue
            self._dispatch(outputs)
        self._drain_inbox()
        self._fail_all()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                handle, prompt_ids, params, priority, request_id, arrival = payload
                try:
                    seq = self.engine.add_request(
                        prompt_ids, params, priority=priority, request_id=request_id, arrival=arrival
                    )
                except Exception as exc:
                    handle.loop.call_soon_threadsafe(_set_exception, handle.admitted, exc)
                    continue
                handle.seq = seq
                self._handles[seq.seq_id] = handle
                handle.loop.call_soon_threadsafe(_set_result, handle.admitted, seq)
            elif kind == "abort":
                found = self.engine.get_request(payload)
                if found is not None and self.engine.abort(payload):
                    self._end(found.seq_id)
            elif kind == "call":
                loop, fut, fn = payload
                try:
                    result = fn(self.engine)
                except Exception as exc:
                    loop.call_soon_threadsafe(_set_exception, fut, exc)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.seq.seq_id)
            if handle is None:
                continue
            handle.loop.call_soon_threadsafe(handle.tokens.put_nowait, out.new_token_ids)
            if out.finished:
                self._end(out.seq.seq_id)

    def _end(self, seq_id: int) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            handle.loop.call_soon_threadsafe(handle.tokens.put_nowait, None)

    def _fail_all(self) -> None:
        for seq_id in list(self._handles):
            seq = self._handles[seq_id].seq
            if seq is not None:
                self.engine.abort(seq.request_id)
                seq.finish_reason = "error"
            self._end(seq_id)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
