"""The open loop every load sender shares: each planned request starts at its offset whether or not earlier
ones have finished (as vLLM's benchmark_serving and k6's arrival-rate executors do), so a slow target sees a
growing queue rather than a politely slowed client.

The wire is the caller's (httpx streaming in the load tester, pre-built bodies from a process of its own in
the vLLM replay, raw sockets in the light bench client): `open_loop` is given the offsets and one coroutine
function called with each request's index, and owns the rest: sleeping until `t0 + offset`, starting each
request without waiting for any other, an optional bound on requests in flight, and how late each started.

Lateness is the client's own: a request's turn came `late_s` after its planned time because the event loop
was busy elsewhere (a slow or overloaded client), and then the target was measured under another load than
the plan's. A wait for a free slot (`max_in_flight`) comes after that; it is in `start_late_s` and counts
the request in `queued`. `lateness` summarises either with the one percentile definition (nearest rank).

The offsets are a list (taken earliest first) or any other iterable, read one offset at a time as the loop
goes: arrivals that depend on what happened so far (a burst until an alert fired) or that never end (a
workload driven until told to stop). `stop`, asked before each request's turn and while waiting for it,
ends the sending: no request starts after it said yes, and those started are awaited.

A request that raises does not stop the others: every request is started and awaited, then the first
exception (in index order) is raised. Cancelling `open_loop` cancels the requests it started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from plumbing.percentile import nearest_rank

T = TypeVar("T")

STOP_POLL_S = 0.05  # how often `stop` is asked while waiting for a request's turn


@dataclass(frozen=True, slots=True)
class Lateness:
    """How late requests started (seconds; None when none was sent)."""

    count: int
    p50_s: float | None
    p99_s: float | None
    max_s: float | None


def lateness(late: Iterable[float | None]) -> Lateness:
    """The summary of `late` (None entries, requests never sent, left out)."""
    values = [x for x in late if x is not None]
    return Lateness(len(values), nearest_rank(values, 0.5), nearest_rank(values, 0.99), max(values, default=None))


@dataclass(frozen=True, slots=True)
class Fired(Generic[T]):
    """An open-loop run, every list by request index (the order of the offsets given), of the requests started
    (all of them unless `stop` ended the run)."""

    results: list[T]
    offsets: list[float]
    dispatched_s: list[float]  # from t0: when each request's turn came (before any wait for a slot)
    started_s: list[float]  # from t0: when its coroutine was called (after that wait)
    queued: int  # requests that found every slot (`max_in_flight`) taken and waited for one
    span_s: float  # from t0 until the last request's turn came

    @property
    def late_s(self) -> list[float]:
        """The client's own lateness: its turn minus its planned time (0 when on time)."""
        return [max(0.0, d - o) for d, o in zip(self.dispatched_s, self.offsets, strict=True)]

    @property
    def start_late_s(self) -> list[float]:
        """When it started minus its planned time, a wait for a slot included."""
        return [max(0.0, s - o) for s, o in zip(self.started_s, self.offsets, strict=True)]


async def open_loop(
    offsets: Iterable[float],
    send: Callable[[int], Awaitable[T]],
    *,
    t0: float | None = None,
    max_in_flight: int | None = None,
    prepare: Callable[[int], Awaitable[object]] | None = None,
    lead_s: float = 0.0,
    stop: Callable[[], bool] | None = None,
) -> Fired[T]:
    """Call `send(i)` at `t0 + offsets[i]` (`time.perf_counter` seconds; t0 defaults to now) for every i,
    earliest offset first (ties in index order; an iterable that is not a sequence in its own order), each
    without waiting for earlier ones; wait for all.

    `max_in_flight` bounds the sends running at once (a request waits for a slot after its turn).
    `prepare(i)`, when given, runs `lead_s` before request i's time (to open its connection, say); the
    request's turn still comes at its offset. `stop()` true: no further request starts."""
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
    if lead_s < 0:
        raise ValueError(f"lead_s: must be >= 0, got {lead_s}")
    start = time.perf_counter() if t0 is None else t0
    lead = lead_s if prepare is not None else 0.0
    planned: dict[int, float] = {}
    dispatched: dict[int, float] = {}
    started: dict[int, float] = {}
    sem = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    queued = 0

    async def one(i: int) -> T:
        nonlocal queued
        if prepare is not None:
            await prepare(i)
            await _until(start + planned[i])
        dispatched[i] = time.perf_counter() - start
        if sem is None:
            started[i] = dispatched[i]
            return await send(i)
        if sem.locked():
            queued += 1
        async with sem:
            started[i] = time.perf_counter() - start
            return await send(i)

    tasks: dict[int, asyncio.Task[T]] = {}
    try:
        for i, offset in _in_order(offsets):
            if not await _until(start + offset - lead, stop):
                break
            planned[i] = offset
            tasks[i] = asyncio.create_task(one(i))
        if tasks:
            await asyncio.wait(tasks.values())
    except BaseException:  # cancelled: the requests started go with it
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    sent = sorted(tasks)
    errors = [exc for i in sent if (exc := tasks[i].exception()) is not None]
    if errors:  # every request has ended; the first failure in index order
        raise errors[0]
    return Fired(
        [tasks[i].result() for i in sent],
        [planned[i] for i in sent],
        [dispatched[i] for i in sent],
        [started[i] for i in sent],
        queued,
        max(dispatched.values(), default=0.0),
    )


def _in_order(offsets: Iterable[float]) -> Iterator[tuple[int, float]]:
    """(index, offset) in sending order: a sequence earliest first, any other iterable as it comes."""
    if isinstance(offsets, Sequence):
        return ((i, offsets[i]) for i in sorted(range(len(offsets)), key=offsets.__getitem__))
    return enumerate(offsets)


async def _until(when: float, stop: Callable[[], bool] | None = None) -> bool:
    """Sleep until `when`; False when `stop` said yes first (asked every `STOP_POLL_S` meanwhile)."""
    while (wait := when - time.perf_counter()) > 0:
        if stop is not None and stop():
            return False
        await asyncio.sleep(wait if stop is None else min(wait, STOP_POLL_S))
    return stop is None or not stop()
