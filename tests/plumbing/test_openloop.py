"""The open loop: each request starts at its offset without waiting for earlier ones, its lateness is
recorded, a slot bound queues requests, and one request's failure stops none of the others."""

from __future__ import annotations

import asyncio
import time

import pytest

from plumbing.openloop import lateness, open_loop


def test_requests_start_at_their_offsets_in_offset_order() -> None:
    offsets = [0.3, 0.0, 0.15, 0.15]  # not sorted: the earliest goes first, ties in index order
    began: list[tuple[int, float]] = []

    async def send(i: int) -> str:
        began.append((i, time.perf_counter() - t0))
        return f"r{i}"

    t0 = time.perf_counter() + 0.05
    fired = asyncio.run(open_loop(offsets, send, t0=t0))
    assert [i for i, _ in began] == [1, 2, 3, 0]
    for i, at in began:
        assert at >= offsets[i] - 0.005, (i, at)  # never early (the sleep's clock granularity aside)
    assert fired.results == ["r0", "r1", "r2", "r3"]  # by index, not by start
    assert fired.offsets == offsets
    assert all(d >= o - 0.005 for d, o in zip(fired.dispatched_s, fired.offsets, strict=True))
    assert fired.span_s == max(fired.dispatched_s) and fired.queued == 0


def test_a_slow_request_does_not_hold_back_later_ones() -> None:
    release = asyncio.Event()
    order: list[str] = []

    async def send(i: int) -> int:
        order.append(f"start {i}")
        if i == 0:
            await release.wait()  # the first request hangs until the last one has started
        elif i == 2:
            release.set()
        order.append(f"end {i}")
        return i

    fired = asyncio.run(asyncio.wait_for(open_loop([0.0, 0.05, 0.1], send), timeout=30))
    assert order.index("start 2") < order.index("end 0")  # open loop: later requests started while 0 was busy
    assert fired.results == [0, 1, 2]


def test_lateness_is_the_clients_own() -> None:
    async def run() -> list[float]:
        async def send(i: int) -> None:
            if i == 0:
                time.sleep(0.4)  # the event loop blocked, as on an overloaded client

        fired = await open_loop([0.0, 0.05, 0.1, 1.0], send)
        return fired.late_s

    late = asyncio.run(run())
    assert late[0] < 0.3
    assert late[1] >= 0.25 and late[2] >= 0.2  # their turns came after the block, far past their time
    assert late[3] < late[1]  # the loop was free again long before 1.0 s
    summary = lateness(late)
    assert summary.count == 4 and summary.max_s == max(late) and summary.p99_s == max(late)
    assert summary.p50_s == sorted(late)[1]  # nearest rank: the 2nd of 4


def test_lateness_summary_of_nothing_sent() -> None:
    assert lateness([]) == lateness([None, None])
    assert lateness([None]).count == 0 and lateness([None]).p99_s is None and lateness([None]).max_s is None
    assert lateness([0.2, None, 0.1]).count == 2


def test_a_slot_bound_queues_requests_after_their_turn() -> None:
    in_flight, peak = 0, 0

    async def send(i: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1

    fired = asyncio.run(open_loop([0.0] * 4, send, max_in_flight=2))
    assert peak == 2 and fired.queued == 2
    late, start_late = fired.late_s, fired.start_late_s
    assert max(late) < 0.15  # each turn came on time ...
    assert sorted(start_late)[2] >= 0.15  # ... and two waited for a slot before they started
    assert all(s >= d for s, d in zip(start_late, late, strict=True))
    with pytest.raises(ValueError, match="max_in_flight"):
        asyncio.run(open_loop([0.0], send, max_in_flight=0))


def test_one_failure_stops_none_of_the_others_and_is_raised_after_all_ended() -> None:
    ended: list[int] = []

    async def send(i: int) -> int:
        await asyncio.sleep(0.05 if i == 3 else 0.0)
        if i in (1, 2):
            raise RuntimeError(f"request {i} broke")
        ended.append(i)
        return i

    with pytest.raises(RuntimeError, match="request 1 broke"):  # the first by index
        asyncio.run(open_loop([0.0, 0.01, 0.0, 0.05], send))
    assert sorted(ended) == [0, 3]  # the later and the slower ones still ran to their end


def test_prepare_runs_ahead_and_the_turn_still_comes_at_the_offset() -> None:
    events: list[tuple[str, int, float]] = []

    async def prepare(i: int) -> None:
        events.append(("prepare", i, time.perf_counter() - t0))

    async def send(i: int) -> int:
        events.append(("send", i, time.perf_counter() - t0))
        return i

    t0 = time.perf_counter() + 0.3
    fired = asyncio.run(open_loop([0.0, 0.2], send, t0=t0, prepare=prepare, lead_s=0.25))
    at = {(kind, i): when for kind, i, when in events}
    assert at[("prepare", 0)] < 0.0 and at[("prepare", 1)] < 0.2  # ahead of each time (planned 0.25 s ahead)
    assert at[("send", 0)] >= -0.005 and at[("send", 1)] >= 0.2 - 0.005
    assert fired.results == [0, 1] and fired.late_s[0] < 0.2


def test_cancelling_the_loop_cancels_the_requests_it_started() -> None:
    cancelled: list[int] = []

    async def send(i: int) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def run() -> None:
        task = asyncio.create_task(open_loop([0.0, 0.0, 60.0], send))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert sorted(cancelled) == [0, 1]


def test_no_requests() -> None:
    async def send(i: int) -> None:
        raise AssertionError("nothing to send")

    fired = asyncio.run(open_loop([], send))
    assert fired.results == [] and fired.late_s == [] and fired.span_s == 0.0


def test_offsets_read_as_the_loop_goes_and_a_stop_that_ends_the_sending() -> None:
    asked: list[int] = []
    sent: list[int] = []

    def offsets():  # never ends: the stop ends it
        i = 0
        while True:
            asked.append(i)
            yield 0.05 * i
            i += 1

    async def send(i: int) -> int:
        sent.append(i)
        await asyncio.sleep(0.1)  # still in flight when the stop comes: awaited, not cancelled
        return i

    began = time.perf_counter()
    fired = asyncio.run(asyncio.wait_for(open_loop(offsets(), send, stop=lambda: len(sent) >= 5), timeout=30))
    assert fired.results == [0, 1, 2, 3, 4] and fired.offsets == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    assert asked == [0, 1, 2, 3, 4, 5]  # read as the loop went: the sixth was asked for, the stop kept it back
    assert time.perf_counter() - began >= 0.3  # the last one ran to its end


def test_a_stop_ends_the_wait_for_a_far_turn() -> None:
    async def send(i: int) -> int:
        return i

    flag = {"stop": False}

    async def run():
        task = asyncio.create_task(open_loop([0.0, 60.0], send, stop=lambda: flag["stop"]))
        await asyncio.sleep(0.1)
        flag["stop"] = True
        return await task

    began = time.perf_counter()
    fired = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert fired.results == [0] and time.perf_counter() - began < 5.0
