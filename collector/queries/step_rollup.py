"""Step load rows for a window: every step, or for a long window the per-minute rollup where it is complete.

A window longer than `ROLLUP_AFTER_S` reads its whole minutes before the rollup's watermark from
`step_rollups` (`collector.rollup`) and only its ragged edges and the minutes after the watermark from the
raw steps, so a week's chart reads thousands of rollup rows instead of millions of steps. The rows have one
shape, (instance, ts, kv_usage_max, running_max, waiting_max, steps, rolled), a rollup row (rolled 1)
standing for its minute's steps: their maxima and count. Maxima of maxima and sums of counts are exact, so
the peaks are the same either way; bucketing them by a multiple of a minute is exact too (minutes nest in
such buckets), and other widths read every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import Connection, Float, Integer, Select, Subquery, cast, func, literal, select, union_all
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from collector.schema import RollupWatermark, StepRollup, StepRow

# Windows longer than this read the rollup: an hour of a 1,000-engine fleet is millions of steps (the fleet
# bench's Overview read an hour of raw steps for 1,000 instances in 2.3-5.4 s p95 beside the ingest), its
# rollup 60,000 rows. Shorter windows are mostly past the watermark (it trails now by up to a maintenance
# interval) and their charts bucket finer than a minute, so they read every step.
ROLLUP_AFTER_S = 15 * 60.0
ROLLUP_BUCKET_S = 60.0
ROLLUP_NOTE = "whole minutes from the per-minute step rollup"
WATERMARK = "steps"  # its row in rollup_watermarks


def load_rows(
    conn: Session | Connection,
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    bucket_s: float | None = None,
) -> tuple[Subquery, bool]:
    """The window's load rows (warm-up steps left out) and whether the rollup was read for part of it."""
    minutes = _rollup_span(conn, start=start, end=end, bucket_s=bucket_s)
    if minutes is None:
        return _raw(start, end, instances, run_id).subquery("load"), False
    lo, hi = minutes
    r = StepRollup.__table__.c
    conds: list[ColumnElement] = [r.bucket_ts >= lo, r.bucket_ts < hi]
    if instances is not None:
        conds.append(r.instance.in_(instances))
    if run_id is not None:
        conds.append(r.run_id == run_id)
    one = cast(literal(1), Integer).label("rolled")
    rolled = select(r.instance, r.bucket_ts.label("ts"), r.kv_usage_max, r.running_max, r.waiting_max, r.steps, one)
    rolled = rolled.where(*conds)
    parts = [rolled, _raw(start, lo, instances, run_id), _raw(hi, end, instances, run_id)]
    return union_all(*parts).subquery("load"), True


def _rollup_span(
    conn: Session | Connection, *, start: float, end: float, bucket_s: float | None
) -> tuple[float, float] | None:
    """The whole minutes [lo, hi) of the window to read from the rollup, or None to read every step."""
    if end - start <= ROLLUP_AFTER_S or (bucket_s is not None and bucket_s % ROLLUP_BUCKET_S):
        return None
    w = RollupWatermark.__table__.c
    through = conn.execute(select(w.through_ts).where(w.name == WATERMARK)).scalar_one_or_none()
    if through is None:
        return None
    lo = math.ceil(start / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S
    hi = min(math.floor(end / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S, float(through))
    return (lo, hi) if hi > lo else None


def _raw(start: float, end: float, instances: Sequence[str] | None, run_id: str | None) -> Select:
    st = StepRow.__table__.c
    conds: list[ColumnElement] = [st.ts >= start, st.ts < end, st.warmup.is_(False)]
    if instances is not None:
        conds.append(st.instance.in_(instances))
    if run_id is not None:
        conds.append(st.run_id == run_id)
    usage = cast(st.kv_blocks_used, Float) / func.nullif(st.kv_blocks_total, 0)
    return select(
        st.instance,
        st.ts,
        usage.label("kv_usage_max"),
        st.num_seqs.label("running_max"),
        st.queue_depth.label("waiting_max"),
        cast(literal(1), Integer).label("steps"),
        cast(literal(0), Integer).label("rolled"),
    ).where(*conds)
