"""The `SeriesSource` over the collector's database, through collector.queries (the one read path).

`ttft_p99_seconds` is the nearest-rank p99 of each instance's minute of finished requests, a point at
the minute's end: `collector.queries.latency_quantiles_over_time(group_by="instance")`, the very figure
the dashboard's TTFT p99 chart shows, user-facing like `headline_latency` (from the HTTP arrival, the
stage before the engine included): what UserTTFTHigh pages on. TTFTRegression asks for a day of it every
evaluation, so the scan goes through the (instance, ts) index (an `instance IN (...)` of the instances seen
in the window), and minutes older than `settle_s` are memoised: a settled minute's value does not change,
so each tick only recomputes the recent ones.
A request pushed more than `settle_s` after it finished is missed by an already-memoised minute.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from sqlalchemy import Engine

from alerts.expr_eval import Labels, Points
from alerts.expr_values import newest_points
from collector import queries
from collector.db import translate_errors

TTFT_P99_BUCKET_S = 60.0
TTFT_QUANTILE = 0.99
DEFAULT_SETTLE_S = 15 * 60.0
MEMO_MAX_AGE_S = 2 * 86400.0

BucketValues = dict[str, dict[float, float]]  # instance -> bucket end -> p99


class SqlSource:
    def __init__(
        self, engine: Engine, *, clock: Callable[[], float] = time.time, settle_s: float = DEFAULT_SETTLE_S
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.settle_s = settle_s
        self._memo: BucketValues = defaultdict(dict)
        self._memo_range: tuple[float, float] | None = None  # bucket ends [lo, hi) held in _memo
        self.p99_queries = 0  # SQL round trips for ttft_p99_seconds (tests and the benchmark read it)

    def points(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, Points]:
        """One entry per stored label set (instance included): rules see every GPU, engine and model."""
        # collector windows are half-open [start, end); the evaluator's are closed.
        stop = math.nextafter(end, math.inf)
        if name == "ttft_p99_seconds":
            p99 = self._ttft_p99(start, stop, instances)
            return {(("instance", inst),): pts for inst, pts in p99.items() if not queries.is_simulated_instance(inst)}
        series = queries.series_points(self.engine, name=name, start=start, end=stop, instances=instances)
        # The tuner's replays are stored beside real traffic with current timestamps: never page for them.
        return {sid.all_labels(): pts for sid, pts in series.items() if not queries.is_simulated_instance(sid.instance)}

    def latest(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, tuple[float, float]]:
        """Each label set's newest sample in [start, end] (`collector.queries.latest_points`: an engine gauge of a
        fleet is one index probe per instance, not every sample of the lookback)."""
        if name == "ttft_p99_seconds":
            return newest_points(self.points(name, start, end, instances))
        stop = math.nextafter(end, math.inf)
        newest = queries.latest_points(self.engine, name=name, start=start, end=stop, instances=instances)
        return {sid.all_labels(): pt for sid, pt in newest.items() if not queries.is_simulated_instance(sid.instance)}

    # --- ttft_p99_seconds -----------------------------------------------------------------------

    def _ttft_p99(self, start: float, stop: float, instances: Sequence[str] | None) -> dict[str, Points]:
        """Points at bucket ends in [start, stop): settled ones from the memo, the rest from SQL."""
        width = TTFT_P99_BUCKET_S
        lo = math.ceil(start / width) * width  # first bucket end >= start
        hi = math.ceil(stop / width) * width  # first bucket end >= stop (excluded)
        settled = min(hi, math.floor((self.clock() - self.settle_s) / width) * width)
        values: BucketValues = defaultdict(dict)
        if settled > lo:
            memo = self._settled(lo, settled)
            for instance, by_end in memo.items():
                if instances is None or instance in instances:
                    values[instance].update((e, v) for e, v in by_end.items() if lo <= e < settled)
        recent_lo = max(lo, settled)
        if hi > recent_lo:
            for instance, by_end in self._query(recent_lo, hi, instances).items():
                values[instance].update(by_end)
        return {inst: sorted(by_end.items()) for inst, by_end in values.items() if by_end}

    def _settled(self, lo: float, hi: float) -> BucketValues:
        """The memo, extended to cover bucket ends [lo, hi) (all instances)."""
        memo_range = self._memo_range
        if memo_range is None or hi < memo_range[0] or lo > memo_range[1]:
            self._memo = defaultdict(dict)
            self._merge(self._query(lo, hi, None))
            self._memo_range = (lo, hi)
            return self._memo
        have_lo, have_hi = memo_range
        if lo < have_lo:
            self._merge(self._query(lo, have_lo, None))
        if hi > have_hi:
            self._merge(self._query(have_hi, hi, None))
        new_lo = min(lo, have_lo)
        floor = self.clock() - MEMO_MAX_AGE_S
        if new_lo < floor:
            new_lo = math.ceil(floor / TTFT_P99_BUCKET_S) * TTFT_P99_BUCKET_S
            for by_end in self._memo.values():
                for e in [e for e in by_end if e < new_lo]:
                    del by_end[e]
        self._memo_range = (new_lo, max(hi, have_hi))
        return self._memo

    def _merge(self, fresh: BucketValues) -> None:
        for instance, by_end in fresh.items():
            self._memo[instance].update(by_end)

    def _query(self, lo: float, hi: float, instances: Sequence[str] | None) -> BucketValues:
        """p99 per (instance, bucket) for bucket ends in [lo, hi) (both multiples of the width)."""
        width = TTFT_P99_BUCKET_S
        ts_lo, ts_hi = lo - width, hi - width  # bucket end e holds ts in [e - width, e)
        out: BucketValues = defaultdict(dict)
        self.p99_queries += 1
        with translate_errors(), self.engine.connect() as conn:
            if instances is None:
                # The index is (instance, ts): name the instances so the range scan can use it.
                instances = [i.name for i in queries.list_instances(conn) if i.last_seen_ts >= ts_lo]
                if not instances:
                    return out
            buckets = queries.latency_quantiles_over_time(
                conn,
                start=ts_lo,
                end=ts_hi,
                bucket_s=width,
                metric="ttft",
                quantiles=(TTFT_QUANTILE,),
                group_by="instance",
                instances=list(instances),
            )
        for b in buckets:
            value = b.quantiles[TTFT_QUANTILE]
            if value is not None:
                out[b.group][b.ts + width] = value
        return out
