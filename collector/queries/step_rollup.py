"""Step load rows for a window: every step, or for a long window the per-minute rollup.

A window longer than `ROLLUP_AFTER_S` (whose chart buckets are whole minutes, if any) reads `step_rollups`
(`collector.rollup`, current to the last batch stored: ingest adds each batch's steps to their minutes) for
every minute the window touches, and no raw step at all, so an hour of a 1,000-engine fleet reads 60,000
rollup rows instead of millions of steps. Its first and last minutes are read whole: the window is widened to
whole minutes (by under a minute at each end), which its source says. The rows have one shape,
(instance, ts, kv_usage_max, running_max, waiting_max, steps, rolled), a rollup row (rolled 1) standing for its
minute's steps: their maxima and count. Maxima of maxima and sums of counts are exact, so the peaks are the
peaks of every step of those minutes; bucketing them by a multiple of a minute is exact too (minutes nest in
such buckets), and other widths read every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import Float, Integer, Select, Subquery, cast, func, literal, select

from collector.queries._base import scope
from collector.schema import StepRollup, StepRow

# Windows longer than this read the rollup: an hour of a 1,000-engine fleet is millions of steps (the fleet
# bench's Overview read them in 2.3-6.8 s p95 beside the ingest), its rollup 60,000 rows. Shorter windows
# chart finer than a minute, and widening them to whole minutes would show what they are not about.
ROLLUP_AFTER_S = 15 * 60.0
ROLLUP_BUCKET_S = 60.0
ROLLUP_NOTE = "whole minutes from the per-minute step rollup"
WATERMARK = "steps"  # its row in rollup_watermarks
ALLOC_WATERMARK = "allocs"  # the allocation rollup's (`collector.queries.engine_stats`)
SAMPLE_WATERMARK = "samples"  # the sample rollup's (`collector.queries.engine_stats`)
SAMPLE_GAUGES = ("kv_usage", "cold_usage", "fragmentation", "internal_waste")  # a sum and a count each


def load_rows(
    *,
    start: float,
    end: float,
    instances: Sequence[str] | None,
    run_id: str | None,
    bucket_s: float | None = None,
) -> tuple[Subquery, bool]:
    """The window's load rows (warm-up steps left out) and whether they are the rollup's (the whole window, in
    whole minutes) rather than every step."""
    if end - start <= ROLLUP_AFTER_S or (bucket_s is not None and bucket_s % ROLLUP_BUCKET_S):
        return _raw(start, end, instances, run_id).subquery("load"), False
    r = StepRollup.__table__.c
    lo = math.floor(start / ROLLUP_BUCKET_S) * ROLLUP_BUCKET_S  # the minute `start` falls in, whole
    conds = scope(StepRollup.__table__, lo, end, instances, run_id, ts="bucket_ts")
    one = cast(literal(1), Integer).label("rolled")
    rolled = select(r.instance, r.bucket_ts.label("ts"), r.kv_usage_max, r.running_max, r.waiting_max, r.steps, one)
    return rolled.where(*conds).subquery("load"), True


def _raw(start: float, end: float, instances: Sequence[str] | None, run_id: str | None) -> Select:
    st = StepRow.__table__.c
    conds = [*scope(StepRow.__table__, start, end, instances, run_id), st.warmup.is_(False)]
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
