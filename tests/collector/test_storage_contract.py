"""Ingest storage contract: atomic, idempotent batches; run on SQLite and PostgreSQL alike."""

from __future__ import annotations

import json
import threading

import pytest
from sqlalchemy import Engine, func, select

from collector import fastdecode
from collector.errors import IdempotencyConflictError
from collector.ingest import BatchTooLargeError, BatchValidationError, parse_batch, store_batch
from collector.schema import AllocRow, IngestBatch, Instance, RequestRow, Run, SampleRow, StepRow
from tests.collector import evfactory as ev


def _count(engine: Engine, model) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()


def _ingest(engine: Engine, events, key):
    raw = ev.body(events)
    return store_batch(engine, parse_batch(raw, max_events=10_000), idempotency_key=key, content=raw)


def test_batch_stores_every_event_type_with_its_fields(db_engine: Engine) -> None:
    result = _ingest(db_engine, ev.mixed(8), "k1")
    assert not result.duplicate and result.events == 8
    assert result.counts == {"request": 2, "step": 2, "alloc": 2, "sample": 2}
    for model in (RequestRow, StepRow, AllocRow, SampleRow):
        assert _count(db_engine, model) == 2
    with db_engine.connect() as conn:
        row = conn.execute(select(RequestRow.__table__).order_by(RequestRow.id)).first()._mapping
        sample = conn.execute(select(SampleRow.__table__).order_by(SampleRow.id)).first()._mapping
    assert row["request_id"] == "q0" and row["ttft_s"] == pytest.approx(0.03) and row["priority"] == 1
    assert row["warmup"] is False and row["batch_id"] == result.batch_id
    assert sample["memory_total_bytes"] == 16 * 2**30 and sample["cold_usage"] is None


def test_swap_seconds_round_trip_and_default_to_zero_for_old_batches(db_engine: Engine) -> None:
    """`swap_s` arrived after the first engines shipped: a batch without it still stores, as 0."""
    old = ev.request(0, request_id="old")
    assert "swap_s" not in old
    fast = [ev.request(1, request_id="swapped", swaps=2, swap_s=0.125), old]
    # The same through the pydantic path: a \\u escape makes msgspec decline the body.
    slow = [ev.request(2, request_id="caf\u00e9", swap_s=0.5), ev.request(3, request_id="old2")]
    assert fastdecode.decode(ev.body(fast)) is not None and fastdecode.decode(ev.body(slow)) is None
    _ingest(db_engine, fast, "swap")
    _ingest(db_engine, slow, "slow")
    with db_engine.connect() as conn:
        got = dict(conn.execute(select(RequestRow.request_id, RequestRow.swap_s)).all())
    assert got == {"swapped": 0.125, "old": 0.0, "caf\u00e9": 0.5, "old2": 0.0}


def test_retried_batch_is_stored_once(db_engine: Engine) -> None:
    events = ev.mixed(40)
    first = _ingest(db_engine, events, "same-key")
    again = _ingest(db_engine, events, "same-key")
    assert again.duplicate and again.batch_id == first.batch_id and again.events == 40
    assert _count(db_engine, RequestRow) == 10
    assert _count(db_engine, IngestBatch) == 1


def test_reused_key_with_other_content_is_a_conflict(db_engine: Engine) -> None:
    _ingest(db_engine, ev.mixed(4), "k")
    with pytest.raises(IdempotencyConflictError, match="already used"):
        _ingest(db_engine, ev.mixed(4, start=100), "k")
    assert _count(db_engine, StepRow) == 1


def test_concurrent_retries_of_one_batch_store_it_once(db_engine: Engine) -> None:
    events = ev.mixed(200)
    results, errors = [], []

    def send() -> None:
        try:
            results.append(_ingest(db_engine, events, "racy"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(not r.duplicate for r in results) == 1
    assert _count(db_engine, RequestRow) == 50


def test_one_bad_event_rejects_the_batch_naming_index_and_field(db_engine: Engine) -> None:
    events = ev.mixed(10)
    events[7] = {**events[7], "kv_usage": "lots"}
    with pytest.raises(BatchValidationError) as info:
        parse_batch(ev.body(events), max_events=100)
    assert info.value.errors[0]["loc"] == "events[7].kv_usage"
    assert _count(db_engine, SampleRow) == 0


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"type": "gauge"}, "events[2]"),
        ({"v": 2}, "events[2].v"),
        ({"ts": -1}, "events[2].ts"),
        ({"surprise": 1}, "events[2].surprise"),
        ({"instance": ""}, "events[2].instance"),
        ({"run_id": "a\u0000b"}, "events[2].run_id"),
    ],
)
def test_rejections_name_the_event(patch: dict, loc: str) -> None:
    events = ev.mixed(4)
    events[2] = {**events[2], **patch}
    with pytest.raises(BatchValidationError) as info:
        parse_batch(ev.body(events), max_events=100)
    assert info.value.errors[0]["loc"] == loc


@pytest.mark.parametrize("bad", [-0.5, "long", None, float("inf")])
def test_bad_swap_seconds_are_422_naming_the_field(bad: object) -> None:
    events = ev.mixed(8)
    events[4] = {**events[4], "swap_s": bad}  # a request event
    with pytest.raises(BatchValidationError) as info:
        parse_batch(json.dumps({"events": events}, allow_nan=True).encode(), max_events=100)
    assert info.value.errors[0]["loc"] == "events[4].swap_s"


def test_event_count_limit() -> None:
    with pytest.raises(BatchTooLargeError):
        parse_batch(ev.body(ev.mixed(11)), max_events=10)


def test_instances_and_runs_are_upserted_with_first_and_last_seen(db_engine: Engine) -> None:
    _ingest(db_engine, [ev.sample(5), ev.sample(9, run_id="r2"), ev.sample(1, instance="e1")], "a")
    _ingest(db_engine, [ev.sample(20), ev.sample(0)], "b")
    with db_engine.connect() as conn:
        inst = {r.name: (r.first_seen_ts, r.last_seen_ts) for r in conn.execute(select(Instance.__table__))}
        runs = {(r.instance, r.run_id): r.last_seen_ts for r in conn.execute(select(Run.__table__))}
    assert inst["e0"] == (ev.T0 + 5, ev.T0 + 20)
    assert inst["e1"] == (ev.T0 + 1, ev.T0 + 1)
    assert runs == {("e0", "r1"): ev.T0 + 20, ("e0", "r2"): ev.T0 + 9, ("e1", "r1"): ev.T0 + 1}


@pytest.mark.parametrize(
    ("event", "loc"),
    [
        (ev.request(0, prompt_tokens=2**31), "events[0].prompt_tokens"),
        (ev.sample(0, memory_used_bytes=2**63), "events[0].memory_used_bytes"),
        (ev.request(0, finish_reason="x" * 65), "events[0].finish_reason"),
        (ev.sample(0, source="s" * 65), "events[0].source"),
    ],
)
def test_values_no_column_can_hold_are_422_not_5xx(event: dict, loc: str) -> None:
    with pytest.raises(BatchValidationError) as info:
        parse_batch(ev.body([event]), max_events=10)
    assert info.value.errors[0]["loc"] == loc


def test_values_at_the_column_limits_are_stored(db_engine: Engine) -> None:
    edge = [
        ev.request(0, prompt_tokens=2**31 - 1, request_id="r" * 200, finish_reason="f" * 64),
        ev.sample(1, memory_used_bytes=2**63 - 1, memory_total_bytes=2**63 - 1, source="s" * 64),
        ev.step(2, step=2**63 - 1, kv_blocks_total=2**63 - 1),
    ]
    result = _ingest(db_engine, edge, "edges")
    assert result.events == 3
    with db_engine.connect() as conn:
        assert conn.execute(select(SampleRow.memory_used_bytes)).scalar_one() == 2**63 - 1
        assert conn.execute(select(RequestRow.prompt_tokens)).scalar_one() == 2**31 - 1
