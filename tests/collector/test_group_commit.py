"""Group commit: pushes queued behind a storage round are stored in one transaction, and each push still meets
exactly what it would have met alone (its refusal, its duplicate, its own batch record). SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from collector import ingest
from collector.claims import CardinalityLimits, Claims, ClaimWindows, InstanceOwnedError
from collector.errors import IdempotencyConflictError
from collector.ingest import BatchValidationError, IngestResult, Push, parse_batch, store_batch, store_pushes
from collector.schema import IngestBatch, Instance, Run, StepRollup, StepRow
from collector.server.admission import StorageGate, round_cost
from tests.collector import evfactory as ev


def _push(claims: Claims, events: list[dict[str, Any]], key: str | None) -> Push:
    return Push(ev.body(events), key, claims, max_events=10_000)


def _alone(engine: Engine, claims: Claims, events: list[dict[str, Any]], key: str) -> IngestResult:
    body = ev.body(events)
    return store_batch(engine, parse_batch(body, max_events=10_000), idempotency_key=key, content=body, claims=claims)


def _scalar(engine: Engine, stmt) -> Any:
    with engine.connect() as conn:
        return conn.execute(stmt).scalar_one()


def test_a_group_gives_each_push_what_it_would_have_met_alone(db_engine: Engine) -> None:
    windows = ClaimWindows(CardinalityLimits())
    alice, bob = Claims("alice", windows), Claims("bob", windows)
    before = _alone(db_engine, alice, ev.mixed(8), "before")  # e0/r1 exist, alice's
    _alone(db_engine, bob, [ev.step(0, instance="bobs")], "bob-0")
    members = [ev.mixed(8, start=100), [ev.step(200 + i) for i in range(5)]]
    pushes = [
        _push(alice, members[0], "g0"),
        _push(alice, members[1], "g1"),
        _push(alice, [ev.step(300, num_seqs=-1)], "bad"),  # invalid: refused alone, by name
        _push(alice, ev.mixed(8), "before"),  # a retry of a stored batch: its duplicate
        _push(alice, members[0], "g0"),  # the same key twice in one group: after the first, a duplicate
        _push(alice, [ev.step(400, run_id="r2")], "new-run"),  # creates a run: stored alone, bounds checked
        _push(alice, [ev.step(500, instance="bobs")], "theirs"),  # bob's instance
        _push(alice, ev.mixed(4, start=600), "before"),  # a stored key, other content
    ]
    out = store_pushes(db_engine, pushes)
    g0, g1, bad, retry, again, new_run, theirs, conflict = out
    assert isinstance(g0, IngestResult) and isinstance(g1, IngestResult) and g0.batch_id != g1.batch_id
    assert (g0.duplicate, g0.events, g0.counts) == (False, 8, {"request": 2, "step": 2, "alloc": 2, "sample": 2})
    assert (g1.duplicate, g1.events, g1.counts) == (False, 5, {"step": 5})
    assert isinstance(bad, BatchValidationError) and "events[0].num_seqs" in str(bad)
    assert isinstance(retry, IngestResult) and retry.duplicate and retry.batch_id == before.batch_id
    assert isinstance(again, IngestResult) and again.duplicate and again.batch_id == g0.batch_id
    assert isinstance(new_run, IngestResult) and not new_run.duplicate and new_run.counts == {"step": 1}
    assert isinstance(theirs, InstanceOwnedError) and isinstance(conflict, IdempotencyConflictError)
    # every row carries its own push's batch id; the rollup and the runs saw the group's rows
    with db_engine.connect() as conn:
        by_batch = dict(conn.execute(select(StepRow.batch_id, func.count()).group_by(StepRow.batch_id)).all())
        records = dict(conn.execute(select(IngestBatch.idempotency_key, IngestBatch.event_count)).all())
        rolled = conn.execute(select(func.sum(StepRollup.steps))).scalar_one()
        last = conn.execute(select(Run.last_seen_ts).where(Run.instance == "e0", Run.run_id == "r1")).scalar_one()
    assert by_batch[g0.batch_id] == 2 and by_batch[g1.batch_id] == 5
    assert records == {"before": 8, "bob-0": 1, "g0": 8, "g1": 5, "new-run": 1}
    assert rolled == 2 + 1 + 2 + 5 + 1  # before, bob-0, g0, g1, new-run
    assert last == ev.T0 + 204
    assert _scalar(db_engine, select(func.count()).select_from(Instance.__table__)) == 2


def test_a_group_whose_key_another_collector_stored_first_stores_each_alone(
    db_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the key lookup saw nothing, another collector committed the key before the group's INSERT.
    The group rolls back whole, and each push is stored alone: the raced one answers as a duplicate."""
    claims = Claims("alice", ClaimWindows(CardinalityLimits()))
    _alone(db_engine, claims, ev.mixed(4), "seed")
    raced = _alone(db_engine, claims, ev.mixed(4, start=10), "raced")
    real, lookups = ingest._find_batches, []

    def before_the_other_committed(engine: Engine, keys: list[str]) -> dict:
        lookups.append(keys)  # the group's lookup saw nothing; every later one sees the database
        return {} if len(lookups) == 1 else real(engine, keys)

    monkeypatch.setattr(ingest, "_find_batches", before_the_other_committed)
    pushes = [_push(claims, ev.mixed(4, start=20), "fresh"), _push(claims, ev.mixed(4, start=10), "raced")]
    fresh, again = store_pushes(db_engine, pushes)
    assert isinstance(fresh, IngestResult) and not fresh.duplicate and fresh.events == 4
    assert isinstance(again, IngestResult) and again.duplicate and again.batch_id == raced.batch_id
    assert _scalar(db_engine, select(func.count()).select_from(IngestBatch.__table__)) == 3


def test_the_storage_gate_groups_what_queued_behind_a_round() -> None:
    """A round in progress; three groupable pushes and one that is not queue behind it. The next round takes
    the three in order; the fourth gets a round of its own. A queued push past its wait leaves ("busy"); one a
    leader took waits for its outcome whatever its clock says."""
    rounds: list[list[str]] = []

    async def scenario() -> list[Any]:
        gate = StorageGate(max_group=8)
        first_open = asyncio.Event()

        async def store(items: list[str]) -> list[str]:
            rounds.append(items)
            if items[0] == "first":
                await first_open.wait()
            await asyncio.sleep(0.3 if items[0] == "a" else 0)  # past "b"'s and "c"'s own wait
            return [f"stored {i}" for i in items]

        never_gone = asyncio.get_running_loop().create_future()  # the client never leaves

        def run(item: str, group: bool, timeout_s: float = 5.0) -> asyncio.Task[Any]:
            return asyncio.ensure_future(
                gate.run(item, store, group=group, timeout_s=timeout_s, gone=never_gone, size=1)
            )

        first = run("first", group=True)
        await asyncio.sleep(0.01)
        queued = [run("a", True), run("b", True, timeout_s=0.5), run("c", True, timeout_s=0.5), run("otlp", False)]
        late = run("late", True, timeout_s=0.05)
        await asyncio.sleep(0.2)  # "late" gave up while the first round held the stage
        first_open.set()
        return [(await t) for t in (first, *queued, late)]

    first, a, b, c, otlp, late = asyncio.run(scenario())
    assert [getattr(x, "outcome", x) for x in (first, a, b, c, otlp, late)] == [
        "stored first",
        "stored a",
        "stored b",
        "stored c",
        "stored otlp",
        "busy",
    ]
    assert rounds == [["first"], ["a", "b", "c"], ["otlp"]]


def _leavable(
    gate: StorageGate, store: Callable[[list[str]], Awaitable[list[str]]], names: tuple[str, ...]
) -> tuple[dict[str, asyncio.Future[Any]], Callable[[str], asyncio.Task[Any]]]:
    """Per name, the future its client's leaving completes (`client_left`'s), and a starter of its push."""
    loop = asyncio.get_running_loop()
    gone = {name: loop.create_future() for name in names}

    def run(name: str) -> asyncio.Task[Any]:
        return asyncio.ensure_future(gate.run(name, store, group=True, timeout_s=30.0, gone=gone[name], size=1))

    return gone, run


def test_a_queued_push_leaves_when_its_client_does() -> None:
    """The client of a queued push disconnects (its `gone` future is done): it leaves at once, before its
    wait is over, and the next round does not hold it."""
    rounds: list[list[str]] = []

    async def scenario() -> tuple[list[Any], float]:
        gate = StorageGate(max_group=8)
        first_open, second_open = asyncio.Event(), asyncio.Event()

        async def store(items: list[str]) -> list[str]:
            rounds.append(items)
            await (first_open if items[0] == "first" else second_open).wait()
            return [f"stored {i}" for i in items]

        loop = asyncio.get_running_loop()
        gone, run = _leavable(gate, store, ("first", "leaves", "stays", "taken"))

        first = run("first")
        await asyncio.sleep(0.01)
        leaves, stays = run("leaves"), run("stays")
        await asyncio.sleep(0.01)
        started = loop.time()
        gone["leaves"].set_result(None)
        left = await leaves
        waited = loop.time() - started
        first_open.set()
        await asyncio.sleep(0.01)  # "stays" leads the next round, held open
        taken = run("taken")
        await asyncio.sleep(0.01)
        gone["taken"].set_result(None)  # queued behind "stays", not yet taken: it leaves too
        taken_out = await taken
        second_open.set()
        return [await first, left, await stays, taken_out], waited

    (first, left, stays, taken), waited = asyncio.run(scenario())
    assert left == "gone" and waited < 0.1  # not after a polling interval, nor after its 30-s wait
    assert taken == "gone"
    assert first.outcome == "stored first" and stays.outcome == "stored stays"
    assert rounds == [["first"], ["stays"]]


def test_a_push_taken_into_a_round_is_answered_though_its_client_left() -> None:
    async def scenario() -> tuple[Any, list[list[str]]]:
        gate = StorageGate(max_group=8)
        first_open, second_open, second_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
        rounds: list[list[str]] = []

        async def store(items: list[str]) -> list[str]:
            rounds.append(items)
            if items == ["first"]:
                await first_open.wait()
            else:
                second_in.set()
                await second_open.wait()
            return [f"stored {i}" for i in items]

        gone, run = _leavable(gate, store, ("first", "second", "third"))

        first = run("first")
        await asyncio.sleep(0.01)
        second, third = run("second"), run("third")
        await asyncio.sleep(0.01)
        first_open.set()  # "second" leads the next round, and takes "third" into it
        await second_in.wait()
        gone["third"].set_result(None)  # its client leaves while its round is in the database
        await asyncio.sleep(0.05)
        second_open.set()
        await asyncio.gather(first, second)
        return await third, rounds

    third, rounds = asyncio.run(scenario())
    assert third.outcome == "stored third" and rounds == [["first"], ["second", "third"]]


def test_the_backlog_is_the_queued_pushes_at_the_pace_of_the_last_rounds() -> None:
    """Rounds of at most 2 pushes, each taking ~0.2 s: while the pushes queued fit in one round there is no
    backlog (the next round takes them all); 4 queued behind a round are ~0.8 s of work."""

    async def scenario() -> tuple[float, float, float]:
        gate = StorageGate(max_group=2)
        opened = asyncio.Event()

        async def store(items: list[str]) -> list[str]:
            await asyncio.sleep(0.2)
            await opened.wait()
            return items

        never_gone = asyncio.get_running_loop().create_future()

        def run(item: str) -> asyncio.Task[Any]:
            return asyncio.ensure_future(gate.run(item, store, group=True, timeout_s=30.0, gone=never_gone, size=1))

        before = gate.backlog_s()  # no round timed yet
        opened.set()
        await asyncio.gather(run("a"), run("b"))  # "a" alone, then "b" alone: two rounds of ~0.2 s
        opened.clear()
        tasks = [run("held")]
        await asyncio.sleep(0)
        tasks += [run("q1"), run("q2")]
        await asyncio.sleep(0)
        fits = gate.backlog_s()  # 2 queued: the next round's
        tasks += [run("q3"), run("q4")]
        await asyncio.sleep(0)
        backlog = gate.backlog_s()
        opened.set()
        await asyncio.gather(*tasks)
        return before, fits, backlog

    before, fits, backlog = asyncio.run(scenario())
    assert before == 0.0 and fits == 0.0
    assert 4 * 0.2 <= backlog < 4 * 0.2 * 1.5  # 4 pushes at the pace of rounds of one push in ~0.2 s


def test_a_backlog_of_pushes_costs_the_rounds_it_fills_not_the_pace_of_small_rounds() -> None:
    """Rounds that cost 0.2 s whatever they hold and 1 ms a push (a transaction's commit against a few rows
    each): after rounds of one, one and seven pushes, 20 pushes queued behind a round of at most 8 are three
    rounds, ~0.62 s; at the pace of the rounds seen (0.61 s for 9 pushes) they would be 1.35 s."""

    async def scenario() -> float:
        gate = StorageGate(max_group=8)
        opened = asyncio.Event()
        opened.set()

        async def store(items: list[str]) -> list[str]:
            await asyncio.sleep(0.2 + 0.001 * len(items))
            await opened.wait()
            return items

        never_gone = asyncio.get_running_loop().create_future()

        def run(item: str) -> asyncio.Task[Any]:
            return asyncio.ensure_future(gate.run(item, store, group=True, timeout_s=30.0, gone=never_gone, size=1))

        await run("alone")
        await asyncio.gather(*[run(f"g{i}") for i in range(8)])  # the first alone, seven in the next round
        opened.clear()
        tasks = [run("held")]
        await asyncio.sleep(0)
        tasks += [run(f"q{i}") for i in range(20)]
        await asyncio.sleep(0)
        backlog = gate.backlog_s()
        opened.set()
        await asyncio.gather(*tasks)
        return backlog

    backlog = asyncio.run(scenario())
    assert 3 * 0.2 + 20 * 0.001 <= backlog < 0.8, backlog


def test_round_cost_splits_a_round_into_its_fixed_part_and_its_pushes() -> None:
    assert round_cost([(1, 0.3), (5, 0.7), (3, 0.5)]) == pytest.approx((0.2, 0.1))
    assert round_cost([(4, 0.4), (4, 0.6)]) == pytest.approx((0.0, 0.125))  # one size: its pace
    assert round_cost([(1, 0.5), (9, 0.3)]) == pytest.approx((0.4, 0.0))  # bigger and cheaper: all per round
    assert round_cost([(1, 0.0), (2, 0.5)]) == pytest.approx((0.0, 0.5 / 3))  # below zero per round: the pace


def test_a_failed_round_gives_every_push_in_it_the_error() -> None:
    async def scenario() -> list[Any]:
        gate = StorageGate(max_group=8)
        hold = asyncio.Event()

        async def store(items: list[str]) -> list[str]:
            if items == ["first"]:
                await hold.wait()
                return ["ok"]
            raise RuntimeError("the database went away")

        never_gone = asyncio.get_running_loop().create_future()  # the client never leaves

        tasks = [
            asyncio.ensure_future(gate.run(i, store, group=True, timeout_s=5.0, gone=never_gone, size=1))
            for i in ("first", "x", "y")
        ]
        await asyncio.sleep(0.05)
        hold.set()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    first, x, y = asyncio.run(scenario())
    assert first.outcome == "ok" and isinstance(x, RuntimeError) and y.outcome.args == ("the database went away",)


def test_otlp_exports_join_a_group_and_a_span_exported_twice_is_stored_once(db_engine: Engine) -> None:
    """Two exports (a source adapter's parsed batches) sharing one span, in one round with a push: one
    transaction, each its own record, the shared span's row stored once (by the first that carries it)."""
    from collector.ingest import batch_from_events
    from collector.schema import OtlpSpan, RequestRow
    from collector.validation import validate_event

    claims = Claims("alice", ClaimWindows(CardinalityLimits()))
    _alone(db_engine, claims, [ev.step(0)], "makes-e0-r1")

    def export(ids: list[int], key: str) -> Push:
        events = [validate_event(ev.request(i, request_id=f"span-{i}")) for i in ids]
        batch = batch_from_events(events, max_events=100, span_ids=[(f"t{i}", f"s{i}") for i in ids])
        return Push(key.encode(), key, claims, max_events=100, parsed=batch)

    groups: list[int] = []
    real_write = ingest._write_group

    def counting(conn: Any, members: list, received: float) -> list[int]:
        groups.append(len(members))
        return real_write(conn, members, received)

    pushes = [export([1, 2, 3], "otlp-a"), _push(claims, [ev.step(10)], "push"), export([3, 4], "otlp-b")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ingest, "_write_group", counting)
        a, push, b = store_pushes(db_engine, pushes)
    assert groups == [3]  # one transaction for the three
    assert isinstance(a, IngestResult) and isinstance(b, IngestResult) and isinstance(push, IngestResult)
    assert (a.counts, b.counts) == ({"request": 3}, {"request": 1})  # span 3 went to the first
    with db_engine.connect() as conn:
        ids = sorted(conn.execute(select(RequestRow.request_id)).scalars())
        spans = conn.execute(select(func.count()).select_from(OtlpSpan.__table__)).scalar_one()
    assert ids == ["span-1", "span-2", "span-3", "span-4"] and spans == 4
    again = store_pushes(db_engine, [export([4, 5], "otlp-c")])[0]  # a later export repeating span 4
    assert isinstance(again, IngestResult) and again.counts == {"request": 1}
