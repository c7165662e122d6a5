"""Retention (`kvpilot db prune`): raw events for N days, 1-minute aggregates of every series for M days.

Before raw rows older than the cutoff are deleted, their canonical series (sample gauges, step
series, scraped points) are aggregated into `samples_downsampled` in the same transaction, so no
value is ever in neither place. The cutoff is aligned to the bucket width: a bucket is never split
between raw and downsampled data, and `collector.queries.series_points` reads both without overlap.

A scraped series keeps its label set: its aggregates are per (instance, name, labels), exactly the raw
`series_points` identity, so GPUs, MIG instances, engines and histogram buckets stay apart in history.
Series from the engine event tables have no labels and are stored with '{}'.

On PostgreSQL the raw tables are partitioned by day (`collector.partitions`): the cutoff is aligned to the
day, and the days before it are dropped whole (their rows counted first), with no mass DELETE; only strays
in a DEFAULT partition are deleted. So PostgreSQL keeps raw rows for `raw_days` plus up to a day. SQLite
deletes rows before the minute-aligned cutoff. The step, allocation and sample rollups (`collector.rollup`)
and the latency sketch and stage sums (`collector.latency_rollup`) are kept as long as the 1-minute aggregates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sqlalchemy import Engine, Float, delete, func, insert, literal, select

from collector import partitions
from collector.db import translate_errors
from collector.exposition import labels_json
from collector.queries import bucket_expr
from collector.schema import (
    AllocRollup,
    AllocRow,
    DownsampledPoint,
    GapRow,
    IngestBatch,
    LatencySketch,
    OtlpSpan,
    RequestRow,
    RequestStageMinute,
    SampleRollup,
    SampleRow,
    SeriesPoint,
    StepRollup,
    StepRow,
)
from collector.series import SAMPLE_COLUMNS, STEP_COLUMNS

DAY = 86_400.0


@dataclass(frozen=True)
class PruneResult:
    raw_cutoff: float
    downsample_cutoff: float
    downsampled_rows: int
    deleted: dict[str, int]


def prune(
    engine: Engine,
    *,
    raw_days: float,
    downsample_days: float,
    bucket_s: float = 60.0,
    now: float | None = None,
) -> PruneResult:
    if raw_days <= 0 or downsample_days <= 0:
        raise ValueError("retention days must be positive")
    if downsample_days < raw_days:
        raise ValueError("downsampled data must be kept at least as long as raw data")
    if DAY % bucket_s:
        raise ValueError("bucket_s must divide a day")
    now = time.time() if now is None else now
    down_cutoff = now - downsample_days * DAY
    d = DownsampledPoint.__table__
    cols = [d.c.instance, d.c.name, d.c.labels, d.c.bucket_ts, d.c.bucket_s, d.c.count, d.c.sum, d.c.min, d.c.max]
    deleted: dict[str, int] = {}
    written = 0
    with translate_errors(), engine.begin() as conn:
        dialect = conn.dialect.name
        by_day = dialect == "postgresql" and partitions.is_partitioned(conn, StepRow.__tablename__)
        align = DAY if by_day else bucket_s
        raw_cutoff = math.floor((now - raw_days * DAY) / align) * align
        for name, column in {**SAMPLE_COLUMNS, **STEP_COLUMNS}.items():
            table = SampleRow.__table__ if name in SAMPLE_COLUMNS else StepRow.__table__
            value = table.c.prefill_tokens + table.c.decode_tokens if name == "step_tokens" else table.c[column]
            bucket = bucket_expr(table.c.ts, bucket_s, dialect).label("bucket")
            src = (
                select(
                    table.c.instance,
                    literal(name),
                    literal(labels_json({})),
                    bucket,
                    literal(bucket_s, Float),
                    func.count(value),
                    func.sum(value),
                    func.min(value),
                    func.max(value),
                )
                .where(table.c.ts < raw_cutoff, value.is_not(None))
                .group_by(table.c.instance, bucket)
            )
            written += max(conn.execute(insert(d).from_select(cols, src)).rowcount or 0, 0)
        # Scraped points: each label set is its own series, bucketed on its own.
        sp = SeriesPoint.__table__
        bucket = bucket_expr(sp.c.ts, bucket_s, dialect).label("bucket")
        src = (
            select(
                sp.c.instance,
                sp.c.name,
                sp.c.labels,
                bucket,
                literal(bucket_s, Float),
                func.count(sp.c.value),
                func.sum(sp.c.value),
                func.min(sp.c.value),
                func.max(sp.c.value),
            )
            .where(sp.c.ts < raw_cutoff)
            .group_by(sp.c.instance, sp.c.name, sp.c.labels, bucket)
        )
        written += max(conn.execute(insert(d).from_select(cols, src)).rowcount or 0, 0)

        if by_day:
            deleted.update(partitions.drop_before(conn, raw_cutoff))
        for model in (RequestRow, StepRow, AllocRow, SampleRow, GapRow, SeriesPoint):
            t = model.__table__
            if t.name not in deleted:
                deleted[t.name] = conn.execute(delete(t).where(t.c.ts < raw_cutoff)).rowcount or 0
        for batch_table in (IngestBatch.__table__, OtlpSpan.__table__):
            expired = batch_table.c.received_at < raw_cutoff
            deleted[batch_table.name] = conn.execute(delete(batch_table).where(expired)).rowcount or 0
        deleted[d.name] = conn.execute(delete(d).where(d.c.bucket_ts < down_cutoff)).rowcount or 0
        for rolled_model in (StepRollup, AllocRollup, SampleRollup, LatencySketch, RequestStageMinute):
            rolled = rolled_model.__table__
            deleted[rolled.name] = conn.execute(delete(rolled).where(rolled.c.bucket_ts < down_cutoff)).rowcount or 0
    return PruneResult(raw_cutoff, down_cutoff, written, deleted)
