"""`collector.queries.stored_steps`: the step rows themselves (what the vLLM cost-model fit reads), on every
storage backend: the window, the filters, warm-up left out, the order and the limit."""

from __future__ import annotations

from sqlalchemy import Engine

from collector import queries as q
from collector.ingest import parse_batch, store_batch
from tests.collector import evfactory as ev

T0 = ev.T0


def _store(engine: Engine, events: list[dict], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=1000), idempotency_key=key, content=raw)


def test_stored_steps_in_their_window_by_instance_run_and_step(db_engine: Engine) -> None:
    events = [
        ev.step(3, instance="e1", run_id="b", prefill_tokens=7, kv_blocks_used=30),
        ev.step(1, instance="e1", run_id="b"),
        ev.step(2, instance="e0", run_id="a", duration_s=0.5, num_seqs=9, decode_tokens=9, kv_blocks_total=64),
        ev.step(0, instance="e0", run_id="a"),
        ev.step(4, instance="e0", run_id="z"),
        ev.step(5, instance="e0", run_id="a", warmup=True),  # a warm-up step is not traffic to fit on
        ev.step(50, instance="e0", run_id="a"),  # past the window
    ]
    _store(db_engine, events, "steps")
    steps = q.stored_steps(db_engine, start=T0, end=T0 + 10)
    assert [(s.instance, s.run_id, s.step) for s in steps] == [
        ("e0", "a", 0),
        ("e0", "a", 2),
        ("e0", "z", 4),
        ("e1", "b", 1),
        ("e1", "b", 3),
    ]
    second = steps[1]
    assert isinstance(second, q.StoredStep) and second.ts == T0 + 2
    assert (second.duration_s, second.num_seqs, second.decode_tokens, second.kv_blocks_total) == (0.5, 9, 9, 64)
    assert (steps[4].prefill_tokens, steps[4].kv_blocks_used, steps[4].kv_blocks_total) == (7, 30, 100)
    assert [s.step for s in q.stored_steps(db_engine, start=T0 + 1, end=T0 + 3)] == [2, 1]  # half-open window
    assert [s.step for s in q.stored_steps(db_engine, start=T0, end=T0 + 10, instances=["e1"])] == [1, 3]
    assert [s.step for s in q.stored_steps(db_engine, start=T0, end=T0 + 10, run_ids=["a", "b"])] == [0, 2, 1, 3]
    assert q.stored_steps(db_engine, start=T0, end=T0 + 10, instances=["e0"], run_ids=["b"]) == []
    assert [s.step for s in q.stored_steps(db_engine, start=T0, end=T0 + 100, limit=2)] == [0, 2]
