"""The per-minute step rollup (`step_rollups`): what history views read instead of every step of a long range.

One row per (instance, run, minute) of non-warm-up steps: how many, their summed duration, and the highest
KV usage, batch size and queue depth among them. A maximum of maxima is the maximum, so peaks read from
the rollup equal the peaks over every step (`collector.queries.step_rollup`).

`roll_up` is run by the collector's maintenance (`collector.maintenance`): it recomputes whole minutes from
`lookback_s` before the watermark up to `settle_s` before now (delete those buckets, insert them again from
the raw steps, move the watermark), so it is idempotent, and a step that arrives late (a spooled batch)
is counted if it arrives within `lookback_s` of the watermark; a later one is only in the raw rows.
Each call covers at most `max_span_s`, so a collector catching up after a long stop does it in steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import Connection, Float, cast, delete, func, insert, literal, select

from collector.queries import bucket_expr
from collector.queries.step_rollup import ROLLUP_BUCKET_S as BUCKET_S
from collector.queries.step_rollup import WATERMARK as STEPS
from collector.schema import RollupWatermark, StepRollup, StepRow


@dataclass(frozen=True)
class RollupResult:
    start: float
    end: float  # the new watermark
    buckets: int


def watermark(conn: Connection, name: str = STEPS) -> float | None:
    w = RollupWatermark.__table__
    return conn.execute(select(w.c.through_ts).where(w.c.name == name)).scalar_one_or_none()


def roll_up(
    conn: Connection, *, now: float, first_start: float, lookback_s: float, settle_s: float, max_span_s: float
) -> RollupResult | None:
    """Recompute the step buckets from the watermark (less `lookback_s`; `first_start` before there is one) to
    `settle_s` before `now`, at most `max_span_s` of them; None when there is nothing to roll up yet."""
    through = watermark(conn)
    start = _floor(first_start if through is None else through - lookback_s)
    end = min(_floor(now - settle_s), start + _floor(max_span_s))
    if end <= start:
        return None
    r = StepRollup.__table__
    st = StepRow.__table__.c
    bucket = bucket_expr(st.ts, BUCKET_S, conn.dialect.name).label("bucket")
    src = (
        select(
            st.instance,
            st.run_id,
            bucket,
            func.count(),
            func.sum(st.duration_s),
            func.max(cast(st.kv_blocks_used, Float) / func.nullif(st.kv_blocks_total, 0)),
            func.max(st.num_seqs),
            func.max(st.queue_depth),
        )
        .where(st.ts >= start, st.ts < end, st.warmup.is_(False))
        .group_by(st.instance, st.run_id, bucket)
    )
    cols = [r.c.instance, r.c.run_id, r.c.bucket_ts, r.c.steps, r.c.duration_sum]
    cols += [r.c.kv_usage_max, r.c.running_max, r.c.waiting_max]
    conn.execute(delete(r).where(r.c.bucket_ts >= start, r.c.bucket_ts < end))
    written = max(conn.execute(insert(r).from_select(cols, src)).rowcount or 0, 0)
    _set_watermark(conn, end, exists=through is not None)
    return RollupResult(start, end, written)


def _set_watermark(conn: Connection, through: float, *, exists: bool) -> None:
    w = RollupWatermark.__table__
    if exists:
        conn.execute(w.update().where(w.c.name == STEPS).values(through_ts=through))
    else:
        conn.execute(insert(w).values(name=STEPS, through_ts=literal(through, Float)))


def _floor(ts: float) -> float:
    return math.floor(ts / BUCKET_S) * BUCKET_S
