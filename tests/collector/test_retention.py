"""`kvpilot db prune`: raw rows go after N days, their 1-minute aggregates stay M days and still answer."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, func, insert, select

from collector import queries as q
from collector.ingest import parse_batch, store_batch
from collector.retention import DAY, prune
from collector.schema import DownsampledPoint, IngestBatch, RequestRow, SampleRow, SeriesPoint, StepRow
from tests.collector import evfactory as ev

OLD = (ev.T0 // 60 + 1) * 60  # a minute boundary
NOW = OLD + 30 * DAY


def count(engine: Engine, model) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()


def ingest(engine: Engine, events: list[dict], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=10_000), idempotency_key=key, content=raw, now=events[0]["ts"])


def test_prune_downsamples_then_deletes(db_engine: Engine) -> None:
    old = [ev.sample(i, ts=OLD + i, kv_usage=(i % 60) / 100) for i in range(120)]
    old += [ev.request(i, ts=OLD + i) for i in range(5)]
    old += [ev.step(i, ts=OLD + i, duration_s=0.01 * (1 + i % 2)) for i in range(60)]
    ingest(db_engine, old, "old")
    recent = [ev.sample(i, ts=NOW - DAY + i, kv_usage=0.9) for i in range(3)]
    ingest(db_engine, recent, "recent")
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [
                {"instance": "gpu", "name": "utilization", "labels": f'{{"gpu":"{g}"}}', "ts": OLD + s, "value": v}
                for s in (0, 15, 30)
                for g, v in (("0", 0.2), ("1", 0.4))
            ],
        )
    before = q.series_points(db_engine, name="kv_usage", start=OLD, end=OLD + 120)["e0"]
    assert len(before) == 120

    result = prune(db_engine, raw_days=7, downsample_days=90, now=NOW)

    assert count(db_engine, SampleRow) == 3 and count(db_engine, RequestRow) == 0 and count(db_engine, StepRow) == 0
    assert count(db_engine, SeriesPoint) == 0 and count(db_engine, IngestBatch) == 1
    assert result.deleted["samples"] == 120 and result.deleted["requests"] == 5
    after = q.series_points(db_engine, name="kv_usage", start=OLD, end=OLD + 120)["e0"]
    mean = pytest.approx(sum(range(60)) / 60 / 100)
    assert after == [(OLD + 30, mean), (OLD + 90, mean)]
    steps = q.series_points(db_engine, name="step_duration_seconds", start=OLD, end=OLD + 60)["e0"]
    assert steps == [(OLD + 30, pytest.approx(0.015))]
    util = q.series_points(db_engine, name="utilization", start=OLD, end=OLD + 60, instances=["gpu"])
    assert util == {"gpu": [(OLD + 30, pytest.approx(0.3))]}  # GPUs combined per scrape, then averaged
    assert q.series_points(db_engine, name="kv_usage", start=NOW - 2 * DAY, end=NOW)["e0"][0][1] == 0.9

    again = prune(db_engine, raw_days=7, downsample_days=90, now=NOW)
    assert again.downsampled_rows == 0 and sum(again.deleted.values()) == 0
    assert q.series_points(db_engine, name="kv_usage", start=OLD, end=OLD + 120)["e0"] == after

    prune(db_engine, raw_days=7, downsample_days=20, now=NOW)
    assert count(db_engine, DownsampledPoint) == 0


def test_prune_validates_arguments(db_engine: Engine) -> None:
    with pytest.raises(ValueError):
        prune(db_engine, raw_days=10, downsample_days=5)
    with pytest.raises(ValueError):
        prune(db_engine, raw_days=0, downsample_days=5)
