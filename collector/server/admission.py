"""Admission control of pushes (/v1/ingest, /v1/traces): bounded work, fast refusals, nothing for the departed.

Each process stores one round at a time (parse and insert both need the GIL, so overlapping them buys
nothing), which makes the storage stage the queue; a round takes the pushes queued behind the one before
it and stores them in one transaction (`StorageGate`, `collector.ingest.store_pushes`). Without a bound,
every sender's body waits in memory for it, senders time out and retry while their abandoned requests are
still processed, and /health queues behind them. So:
- at most `max_inflight_requests` pushes are admitted at once; the next is answered 429 at once;
- admitted pushes hold at most `max_inflight_bytes` of bodies, counted as they arrive and as they
  inflate (in a worker thread, a chunk at a time, stopping at the per-request limit: 413, or at the
  budget: 429), so 30 padded gzip bodies cannot take the process to gigabytes, and the rows they
  parse into (`Ticket.reserve_rows`: pushes and OTLP exports alike) count too;
- an admitted push waits at most `storage_wait_s` for the storage stage (first come, first served):
  503, the database is the bottleneck; a push whose client disconnected leaves the queue unprocessed (one
  wait on its connection, `client_left`, not a question asked every few tenths of a second: the queue is
  longest when the process has the least CPU to spare);
- a push that would queue behind more than a round's worth of pushes (`ingest_group_max_batches`) that the
  storage stage needs longer than `storage_wait_s` for (the rounds they fill, each at what its last rounds
  cost: a part per round and a part per push, `round_cost`), is answered 503 when
  it arrives (`storage_backlog`), before its body is read and parsed: it would have waited its time out, and
  its parsing taken CPU from the pushes ahead of it (under sustained overload the late 503s and the retries
  they bring were work the collector did for nothing);
- every refusal carries `Retry-After`, is counted in `kvpilot_collector_ingest_rejected_total{reason}`
  and logged at most once per reason every few seconds (`errors.RefusalLog`).
`kvpilot_collector_inflight_requests` and `kvpilot_collector_inflight_bytes` show the two budgets in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from prometheus_client import CollectorRegistry, Gauge, Histogram
from starlette.requests import ClientDisconnect

from collector.server.errors import Rejected
from collector.settings import CollectorSettings

ROW_BYTES = 512  # a parsed event's row tuple in memory, about (measured: 1.8x its JSON text)
INFLATE_CHUNK = 1 << 20  # inflated bytes per step: the budget is checked between steps
MAX_RETRY_AFTER_S = 30
# Inflating is CPU work outside the GIL: a thread per push would starve the event loop (and /health) of
# the CPU itself, so bodies inflate two at a time; the others wait holding only their wire bytes.
INFLATE_WORKERS = 2


class Admission:
    """The two budgets of one collector process and its storage queue; shared by all pushes."""

    def __init__(self, settings: CollectorSettings, registry: CollectorRegistry) -> None:
        self.max_requests = settings.max_inflight_requests
        self.max_bytes = settings.max_inflight_bytes
        self.storage_wait_s = settings.storage_wait_s
        self.body_timeout_s = settings.body_timeout_s
        self.retry_after_s = settings.retry_after_s
        self._refusals = (0, 0, 0)  # (second, refusals in it, refusals in the second before)
        self._refusals_lock = threading.Lock()  # not `_lock`: refusals are made while holding that
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()  # reservations come from the event loop and from worker threads
        groups = Histogram(
            "kvpilot_collector_ingest_group_batches",
            "pushes stored per storage round (group commit; 1: alone)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=registry,
        )
        self.gate = StorageGate(
            max_group=settings.ingest_group_max_batches,
            max_bytes=settings.max_decompressed_bytes,
            observe=groups.observe,
        )
        self.inflaters = ThreadPoolExecutor(max_workers=INFLATE_WORKERS, thread_name_prefix="kvpilot-inflate")
        Gauge("kvpilot_collector_inflight_requests", "pushes admitted now", registry=registry).set_function(
            lambda: self.requests
        )
        Gauge("kvpilot_collector_inflight_bytes", "body bytes held by admitted pushes", registry=registry).set_function(
            lambda: self.bytes
        )

    def retry_after(self) -> int:
        """`retry_after_s`, times how many in-flight bounds' worth of pushes were refused in the last second:
        256 senders told to come back in 1 s would come back together; told in proportion, they spread."""
        now = int(time.monotonic())
        with self._refusals_lock:
            second, current, previous = self._refusals
            if now != second:
                current, previous = 0, (current if now == second + 1 else 0)
            current += 1
            self._refusals = (now, current, previous)
        crowd = max(current, previous) // self.max_requests
        return min(self.retry_after_s * max(1, crowd), MAX_RETRY_AFTER_S)

    def refusal(self) -> Rejected | None:
        """The refusal of a push arriving now, None when it is admitted: 429 at the in-flight bound, 503 when the
        storage stage is backlogged (`StorageGate.backlog_s`)."""
        if self.requests >= self.max_requests:
            return self.overloaded(429, "overloaded", f"{self.requests} pushes in flight, the limit; retry later")
        backlog = self.gate.backlog_s()
        if backlog > self.storage_wait_s:
            detail = (
                f"the database needs {backlog:.1f}s for the pushes queued, over the {self.storage_wait_s:g}s a push"
                " may wait; retry later"
            )
            return self.overloaded(503, "storage_backlog", detail)
        return None

    async def inflate(
        self, data: bytes, *, limit: int, ticket: Ticket, coding: Literal["gzip", "deflate"] = "gzip"
    ) -> bytes:
        """`inflate` on one of the inflater threads."""
        work = functools.partial(inflate, data, limit=limit, ticket=ticket, coding=coding)
        return await asyncio.get_running_loop().run_in_executor(self.inflaters, work)

    def close(self) -> None:
        self.inflaters.shutdown(wait=True, cancel_futures=True)

    def overloaded(self, status: int, reason: str, detail: str) -> Rejected:
        return Rejected(status, reason, detail, headers={"Retry-After": str(self.retry_after())})

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[Ticket]:
        """A slot for one push, or 429 now; the bytes it reserved are given back when it ends."""
        with self._lock:
            refused = self.refusal()
            if refused is not None:
                raise refused
            self.requests += 1
        ticket = Ticket(self)
        try:
            yield ticket
        finally:
            with self._lock:
                self.bytes -= ticket.held
                self.requests -= 1
            ticket.held = 0

    async def store(
        self,
        request: Request,
        item: Any,
        store: Callable[[list[Any]], Awaitable[list[Any]]],
        *,
        group: bool,
        size: int,
        count: int = 1,
    ) -> Any:
        """`item` stored by the storage stage (`StorageGate`: alone, or in a group when `group`), its outcome; 503
        past `storage_wait_s` in the queue; a client that left while queued is not served. An outcome that is an
        error is raised."""
        left = asyncio.ensure_future(client_left(request))
        try:
            served = await self.gate.run(
                item, store, group=group, size=size, count=count, timeout_s=self.storage_wait_s, gone=left
            )
        finally:
            left.cancel()
        if served == "busy":
            raise self.overloaded(
                503, "storage_busy", f"the database did not take the batch within {self.storage_wait_s:g}s; retry later"
            )
        if served == "gone":
            raise client_gone()
        if isinstance(served.outcome, BaseException):
            raise served.outcome
        return served.outcome


class Ticket:
    """The bytes one admitted push holds; `reserve` is called from the event loop and worker threads."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = 0

    def reserve(self, n: int) -> None:
        adm = self.admission
        with adm._lock:
            if adm.bytes + n > adm.max_bytes:
                detail = f"{adm.bytes} body bytes in flight, the limit is {adm.max_bytes}; retry later"
                raise adm.overloaded(429, "overloaded_bytes", detail)
            adm.bytes += n
            self.held += n

    def reserve_rows(self, rows: int) -> None:
        """Room for `rows` parsed events held until the push ends (their tuples, not their text: `ROW_BYTES`)."""
        self.reserve(ROW_BYTES * rows)

    def give_back(self, n: int) -> None:
        with self.admission._lock:
            n = min(n, self.held)
            self.admission.bytes -= n
            self.held -= n


@dataclass(eq=False)
class _Waiter:
    item: Any
    size: int  # the item's bytes, for the group's bound
    count: int  # the pushes it holds (a bundle: its members), for the group's bound and the histogram
    turn: asyncio.Future[Any]  # None: this push leads the next round; `_Served`: a leader stored it
    taken: bool = False  # a leader took it into its round: it waits for the outcome, it may no longer leave


@dataclass(frozen=True)
class _Served:
    outcome: Any  # the store's outcome for the item (a result, or the exception it met)


def round_cost(rounds: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """(seconds a round costs whatever it holds, seconds each push in it adds), fitted by least squares to
    rounds' (pushes, seconds). A group's cost is mostly per round (the transaction, the claims' reads, the
    commit's flush): pricing every queued push at the pace of the last rounds, small ones, made a backlog look
    several times what the full rounds that clear it take (a fleet's collectors refused pushes at a third of
    their capacity while a round waited on the database). Rounds all of one size cannot tell the parts apart:
    then each push costs their pace, as under a sustained overload, whose rounds are all full. Neither part is
    negative: where the fit says one is, the other takes it all."""
    sizes, times = zip(*rounds, strict=True)
    mean_n, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    if spread == 0:
        return 0.0, mean_t / mean_n
    per_push = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, times, strict=True)) / spread
    if per_push <= 0:
        return mean_t, 0.0
    fixed = mean_t - per_push * mean_n
    if fixed < 0:
        return 0.0, sum(times) / sum(sizes)
    return fixed, per_push


class StorageGate:
    """The storage stage: one round at a time, first come first served, a round storing one push or a group
    (group commit). The push whose turn comes leads the round: it takes the groupable pushes queued right
    behind it (at most `max_group` in all and `max_bytes` of bodies), stores them together in a worker thread
    (the store callable it was given), and hands each its own outcome. A queued push may leave (timeout,
    client gone) until a leader took it; once taken, it waits for its outcome. Event-loop only. No `wait_for`
    on a future: a cancellation racing a grant could leak the stage. `observe` is told how many pushes each
    round held (`kvpilot_collector_ingest_group_batches`)."""

    ROUNDS_PACED = 16  # the last rounds whose cost `backlog_s` reads

    def __init__(self, *, max_group: int = 1, max_bytes: int = 1 << 62, observe: Callable[[int], None] | None = None):
        self.max_group, self.max_bytes, self.observe = max_group, max_bytes, observe
        self._held = False
        self._waiters: deque[_Waiter] = deque()
        self._rounds: deque[tuple[int, float]] = deque(maxlen=self.ROUNDS_PACED)  # (pushes, seconds) of each

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def backlog_s(self) -> float:
        """Seconds the stage would take for the pushes queued at it: the rounds they fill, each costing what a
        round costs whatever it holds plus what each push in it costs (`round_cost`, from the last rounds); 0
        while they fit in one round (the next round takes them all) and before any round was timed."""
        queued = sum(w.count for w in self._waiters)
        if queued <= self.max_group or not self._rounds:
            return 0.0
        fixed, per_push = round_cost(self._rounds)
        return -(-queued // self.max_group) * fixed + queued * per_push

    async def run(
        self,
        item: Any,
        store: Callable[[list[Any]], Awaitable[list[Any]]],
        *,
        group: bool,
        size: int = 0,
        count: int = 1,
        timeout_s: float,
        gone: asyncio.Future[Any],
    ) -> Any:
        """`item`'s outcome from `store` (one outcome per item, in order; an exception is an outcome to raise),
        in its own round or in a leader's group (`group`: it may share a round with others that may); "busy"
        past `timeout_s` in the queue, "gone" when `gone` (done when the client left: `client_left`) is done
        while it is queued. `count`: the pushes `item` holds (a bundle's members), counted against
        `max_group`."""
        waiter = _Waiter(item if group else None, size, count, asyncio.get_running_loop().create_future())
        if self._held or self._waiters:
            outcome = await self._wait(waiter, timeout_s, gone)
            if outcome is not None:
                return outcome
        else:
            self._held = True
        return await self._lead(item, waiter, store)

    async def _wait(self, waiter: _Waiter, timeout_s: float, gone: asyncio.Future[Any]) -> Any:
        """Queue until this push leads a round (None), a leader served it (its outcome), or it leaves. It wakes
        when one of those happens, not on a clock."""
        loop = asyncio.get_running_loop()
        self._waiters.append(waiter)
        deadline = loop.time() + timeout_s
        turn = waiter.turn
        try:
            while not turn.done():
                if waiter.taken:  # in a leader's round: its outcome comes whatever the clock says
                    await asyncio.wait([turn])
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self._leave(waiter)
                    return "busy"
                # never cancels `turn`; a `gone` done already returns at once, and is acted on below
                await asyncio.wait([turn, gone], timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if gone.done() and not turn.done() and not waiter.taken:
                    self._leave(waiter)
                    return "gone"
        except BaseException:
            self._leave(waiter)
            raise
        result = turn.result()
        return result if isinstance(result, _Served) else None

    async def _lead(self, item: Any, waiter: _Waiter, store: Callable[[list[Any]], Awaitable[list[Any]]]) -> Any:
        followers = self._take(waiter) if waiter.item is not None else []
        items = [item, *(f.item for f in followers)]
        count = waiter.count + sum(f.count for f in followers)
        if self.observe is not None:
            self.observe(count)
        loop = asyncio.get_running_loop()
        started = loop.time()
        task = asyncio.ensure_future(store(items))

        def finish(done: asyncio.Future[list[Any]]) -> None:
            """Every follower gets its outcome, and the stage passes on, whatever became of the leader."""
            self._rounds.append((count, loop.time() - started))
            failed = asyncio.CancelledError() if done.cancelled() else done.exception()
            outcomes = [failed] * len(items) if failed is not None else done.result()
            for follower, outcome in zip(followers, outcomes[1:], strict=True):
                follower.turn.set_result(_Served(outcome))
            self.release()

        task.add_done_callback(finish)
        return _Served((await asyncio.shield(task))[0])

    def _take(self, leader: _Waiter) -> list[_Waiter]:
        """The groupable pushes right behind the leader, within the group's bounds; taken off the queue."""
        taken: list[_Waiter] = []
        size, count = leader.size, leader.count
        while self._waiters:
            nxt = self._waiters[0]
            full = count + nxt.count > self.max_group or size + nxt.size > self.max_bytes
            if nxt.item is None or nxt.turn.done() or full:
                break
            self._waiters.popleft()
            nxt.taken = True
            size += nxt.size
            count += nxt.count
            taken.append(nxt)
        return taken

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.turn.done():  # handed over meanwhile: pass it on (a served push never leaves)
            if waiter.turn.result() is None:
                self.release()
        elif not waiter.taken:
            self._waiters.remove(waiter)
            waiter.turn.cancel()

    def release(self) -> None:
        while self._waiters:
            nxt = self._waiters.popleft()
            if not nxt.turn.done():
                nxt.turn.set_result(None)  # stays held, by the next in line
                return
        self._held = False


async def client_left(request: Request) -> None:
    """Returns when the client of `request`, whose body was read, disconnects: the server's next message on it
    is `http.disconnect` (uvicorn sends it when the connection drops, or once the response is sent). Anything
    else is not expected after the body and is waited past."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # no busy loop on a server that repeats itself


def client_gone() -> Rejected:
    return Rejected(499, "client_disconnected", "the client disconnected; the push was not processed")


async def read_body(request: Request, ticket: Ticket, limit: int) -> bytes:
    """The body, at most `limit` bytes (413), reserved against the byte budget as it arrives (429), within
    `body_timeout_s` (408: a client trickling its body must not hold a slot for ever)."""
    declared = request.headers.get("content-length")
    reserved = 0
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise Rejected(413, "too_large", f"body of {declared} bytes exceeds the limit of {limit}")
        ticket.reserve(int(declared))
        reserved = int(declared)
    buf = bytearray()
    timeout_s = ticket.admission.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise Rejected(413, "too_large", f"body exceeds the limit of {limit} bytes")
                if len(buf) > reserved:
                    ticket.reserve(len(buf) - reserved)
                    reserved = len(buf)
    except ClientDisconnect:
        raise client_gone() from None
    except TimeoutError:
        raise Rejected(408, "body_timeout", f"the body did not arrive within {timeout_s:g}s") from None
    return bytes(buf)


def inflate(data: bytes, *, limit: int, ticket: Ticket, coding: Literal["gzip", "deflate"] = "gzip") -> bytes:
    """Decompress one gzip member (or zlib stream: HTTP's deflate) a chunk at a time, each chunk reserved
    against the byte budget; stops at `limit` (413: zip bombs) and refuses trailing junk. Run it on
    `Admission.inflaters`: inflating tens of MiB would stall the event loop and /health with it."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS)
    reason = f"bad_{coding}"
    parts: list[bytes] = []
    size = 0
    pending = data
    try:
        while not inflater.eof:
            part = inflater.decompress(pending, INFLATE_CHUNK)
            pending = inflater.unconsumed_tail
            if not part and not pending:
                break
            size += len(part)
            if size > limit:
                raise Rejected(413, "too_large", f"decompressed body exceeds the limit of {limit} bytes")
            ticket.reserve(len(part))
            parts.append(part)
    except zlib.error as exc:
        raise Rejected(400, reason, f"body is not valid {coding}: {exc}") from exc
    if not inflater.eof:
        raise Rejected(400, reason, f"{coding} body is truncated")
    if inflater.unused_data:
        raise Rejected(400, reason, f"data after the end of the {coding} stream")
    if len(parts) == 1:
        return parts[0]
    ticket.reserve(size)  # joining the parts needs the inflated size twice, for a moment
    body = b"".join(parts)
    parts.clear()
    ticket.give_back(size)
    return body
