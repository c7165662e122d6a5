"""Gap records: stored through the ingest path, read as events_lost_total{kind, reason} and per window."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Engine, text

from collector import queries as q
from collector.ingest import BatchValidationError, parse_batch, store_batch
from collector.queries import SeriesId
from tests.collector import evfactory as ev

T0 = ev.T0
SPOOL = (("kind", "request"), ("reason", "spool_full"))


def ingest(engine: Engine, events: list[dict], key: str, *, escaped: bool = False) -> None:
    raw = ev.body(events)
    if escaped:  # a \u escape sends the body down the pydantic path instead of msgspec's
        raw = raw.replace(b'"r1"', b'"\\u0072\\u0031"')
    store_batch(engine, parse_batch(raw, max_events=1000), idempotency_key=key, content=raw)


def test_gap_records_are_stored_on_both_validation_paths(db_engine: Engine) -> None:
    ingest(db_engine, [ev.gap(0, events=5)], "fast")
    ingest(db_engine, [ev.gap(1, kind="sample", reason="unauthorized", events=7)], "slow", escaped=True)
    with db_engine.connect() as conn:
        rows = conn.execute(text("SELECT run_id, kind, reason, events FROM gaps ORDER BY ts")).all()
    assert [tuple(r) for r in rows] == [("r1", "request", "spool_full", 5), ("r1", "sample", "unauthorized", 7)]


@pytest.mark.parametrize("bad", [{"events": 0}, {"reason": "tired"}, {"kind": "gap"}])
def test_bad_gap_records_are_refused_by_name(db_engine: Engine, bad: dict) -> None:
    with pytest.raises(BatchValidationError) as info:
        ingest(db_engine, [ev.gap(0, **bad)], "bad")
    assert info.value.errors[0]["loc"] == f"events[0].{next(iter(bad))}"


def test_events_lost_total_steps_at_each_gap_record_even_without_samples(db_engine: Engine) -> None:
    ingest(db_engine, [ev.gap(5, events=100), ev.gap(8, events=63), ev.gap(6, reason="rejected", events=2)], "g")
    series = q.series_points(db_engine, name="events_lost_total", start=T0, end=T0 + 10)
    assert set(series) == {SeriesId("e0", SPOOL), SeriesId("e0", (("kind", "request"), ("reason", "rejected")))}
    spool = series[SeriesId("e0", SPOOL)]
    assert [v for _, v in spool] == [0, 100, 100, 163]
    assert q.counter_increase(db_engine, name="events_lost_total", start=T0, end=T0 + 10)[
        SeriesId("e0", SPOOL)
    ] == pytest.approx(163)


def test_events_lost_total_on_the_sample_grid(db_engine: Engine) -> None:
    ingest(db_engine, [ev.sample(i) for i in range(10)] + [ev.gap(4, events=30)], "grid")
    points = q.series_points(db_engine, name="events_lost_total", start=T0, end=T0 + 10)[SeriesId("e0", SPOOL)]
    at_samples = [v for ts, v in points if ts == int(ts)]  # the samples' whole seconds (and the record's)
    assert at_samples == [0, 0, 0, 0, 30, 30, 30, 30, 30, 30, 30]
    assert q.series_points(db_engine, name="events_lost_total", start=T0, end=T0 + 10, instances=["e1"]) == {}


def test_lost_events_per_window_by_the_lost_span(db_engine: Engine) -> None:
    ingest(
        db_engine,
        [
            ev.gap(100, events=40, first_ts=T0 + 10, last_ts=T0 + 90),
            ev.gap(100, kind="sample", events=3, first_ts=T0 + 50, last_ts=T0 + 60),
            ev.gap(300, events=9, first_ts=T0 + 200, last_ts=T0 + 250, run_id="r2"),
        ],
        "w",
    )
    lost = q.lost_events(db_engine, start=T0, end=T0 + 100)
    assert [(r.kind, r.reason, r.events, r.first_ts, r.last_ts) for r in lost] == [
        ("request", "spool_full", 40, T0 + 10, T0 + 90),
        ("sample", "spool_full", 3, T0 + 50, T0 + 60),
    ]
    assert [r.events for r in q.lost_events(db_engine, start=T0 + 80, end=T0 + 400)] == [49]
    assert q.lost_events(db_engine, start=T0, end=T0 + 400, run_id="r2")[0].events == 9
    assert q.lost_events(db_engine, start=T0, end=T0 + 400, instances=["e1"]) == []
    assert json.dumps([r.__dict__ for r in lost])  # plain values for the dashboard
