"""`kvpilot db prune`: raw rows go after N days, their 1-minute aggregates stay M days, per label set.

Assertions read the raw `samples_downsampled` rows; how the read side serves them is tested there.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Engine, func, insert, select

from collector.ingest import parse_batch, store_batch
from collector.retention import DAY, prune
from collector.schema import DownsampledPoint, IngestBatch, RequestRow, SampleRow, SeriesPoint, StepRow
from tests.collector import evfactory as ev

OLD = (ev.T0 // 60 + 1) * 60  # a minute boundary
NOW = OLD + 30 * DAY


def count(engine: Engine, model) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model.__table__)).scalar_one()


def ingest(engine: Engine, events: list[dict], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=10_000), idempotency_key=key, content=raw, now=events[0]["ts"])


def downsampled(engine: Engine, name: str) -> list[tuple[str, dict[str, str], float, int, float, float, float]]:
    """(instance, labels, bucket_ts, count, mean, min, max) rows of one series, in a stable order."""
    d = DownsampledPoint.__table__
    stmt = select(d.c.instance, d.c.labels, d.c.bucket_ts, d.c.count, d.c.sum, d.c.min, d.c.max, d.c.bucket_s)
    with engine.connect() as conn:
        rows = conn.execute(stmt.where(d.c.name == name)).all()
    rows.sort(key=lambda r: (r.instance, r.labels, r.bucket_ts))  # in Python: SQL text order follows collation
    assert all(r.bucket_s == 60.0 for r in rows)
    return [(r.instance, json.loads(r.labels), r.bucket_ts, r.count, r.sum / r.count, r.min, r.max) for r in rows]


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
    assert count(db_engine, SampleRow) == 123

    result = prune(db_engine, raw_days=7, downsample_days=90, now=NOW)

    assert count(db_engine, SampleRow) == 3 and count(db_engine, RequestRow) == 0 and count(db_engine, StepRow) == 0
    assert count(db_engine, SeriesPoint) == 0 and count(db_engine, IngestBatch) == 1
    assert result.deleted["samples"] == 120 and result.deleted["requests"] == 5
    mean = pytest.approx(sum(range(60)) / 60 / 100)
    kv = downsampled(db_engine, "kv_usage")
    assert kv == [("e0", {}, OLD, 60, mean, 0.0, 0.59), ("e0", {}, OLD + 60, 60, mean, 0.0, 0.59)]
    steps = downsampled(db_engine, "step_duration_seconds")
    assert steps == [("e0", {}, OLD, 60, pytest.approx(0.015), 0.01, 0.02)]
    util = [row for row in downsampled(db_engine, "utilization") if row[0] == "gpu"]
    assert util == [  # each GPU is its own series in history too
        ("gpu", {"gpu": "0"}, OLD, 3, pytest.approx(0.2), 0.2, 0.2),
        ("gpu", {"gpu": "1"}, OLD, 3, pytest.approx(0.4), 0.4, 0.4),
    ]

    again = prune(db_engine, raw_days=7, downsample_days=90, now=NOW)
    assert again.downsampled_rows == 0 and sum(again.deleted.values()) == 0
    assert downsampled(db_engine, "kv_usage") == kv

    prune(db_engine, raw_days=7, downsample_days=20, now=NOW)
    assert count(db_engine, DownsampledPoint) == 0


def test_prune_keeps_scraped_label_sets_apart(db_engine: Engine) -> None:
    """Engines, MIG instances and histogram buckets of one instance stay distinct series in history."""
    llama = {"engine": "0", "model_name": "llama"}
    sets = [
        ("vllm-0", "ttft_seconds_bucket", {**llama, "le": "0.1"}, 4.0),
        ("vllm-0", "ttft_seconds_bucket", {**llama, "le": "+Inf"}, 10.0),
        ("vllm-0", "ttft_seconds_bucket", {**llama, "engine": "1", "le": "+Inf"}, 7.0),
        ("node-0", "memory_used_bytes", {"gpu": "2", "GPU_I_ID": "1"}, 30.0),
        ("node-0", "memory_used_bytes", {"gpu": "2", "GPU_I_ID": "2"}, 20.0),
    ]
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [
                {"instance": inst, "name": name, "labels": json.dumps(dict(sorted(labels.items()))).replace(" ", ""),
                 "ts": OLD + s, "value": v + s}
                for inst, name, labels, v in sets
                for s in (0, 30)
            ],
        )  # fmt: skip

    prune(db_engine, raw_days=7, downsample_days=90, now=NOW)

    buckets = downsampled(db_engine, "ttft_seconds_bucket")
    assert [(labels, n, lo, hi) for _, labels, _, n, _, lo, hi in buckets] == [
        ({**llama, "le": "+Inf"}, 2, 10.0, 40.0),
        ({**llama, "le": "0.1"}, 2, 4.0, 34.0),
        ({**llama, "engine": "1", "le": "+Inf"}, 2, 7.0, 37.0),
    ]
    memory = downsampled(db_engine, "memory_used_bytes")
    assert [(inst, labels["GPU_I_ID"], lo, hi) for inst, labels, _, _, _, lo, hi in memory] == [
        ("node-0", "1", 30.0, 60.0),
        ("node-0", "2", 20.0, 50.0),
    ]


def test_prune_validates_arguments(db_engine: Engine) -> None:
    with pytest.raises(ValueError):
        prune(db_engine, raw_days=10, downsample_days=5)
    with pytest.raises(ValueError):
        prune(db_engine, raw_days=0, downsample_days=5)
