"""The `SeriesSource` over the collector's database, through collector.queries (the one read path)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import Engine, select

from alerts.expr_eval import Points
from collector import queries
from collector.schema import RequestRow

TTFT_P99_BUCKET_S = 60.0


class SqlSource:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def points(self, name: str, start: float, end: float, instances: Sequence[str] | None = None) -> dict[str, Points]:
        # collector windows are half-open [start, end); the evaluator's are closed.
        stop = math.nextafter(end, math.inf)
        if name == "ttft_p99_seconds":
            return self._ttft_p99(start, stop, instances)
        return queries.series_points(self.engine, name=name, start=start, end=stop, instances=instances)

    def _ttft_p99(self, start: float, stop: float, instances: Sequence[str] | None) -> dict[str, Points]:
        """p99 (nearest rank, as collector.queries) of TTFT per instance per minute; a point at each minute's end."""
        stmt = select(RequestRow.instance, RequestRow.ts, RequestRow.ttft_s).where(
            RequestRow.ts >= start - TTFT_P99_BUCKET_S, RequestRow.ts < stop, RequestRow.ttft_s.is_not(None),
            RequestRow.warmup.is_(False))
        if instances is not None:
            stmt = stmt.where(RequestRow.instance.in_(list(instances)))
        buckets: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        with self.engine.connect() as conn:
            for instance, ts, ttft in conn.execute(stmt):
                bucket_end = (math.floor(ts / TTFT_P99_BUCKET_S) + 1) * TTFT_P99_BUCKET_S
                buckets[instance][bucket_end].append(float(ttft))
        out: dict[str, Points] = {}
        for instance, by_bucket in buckets.items():
            pts = []
            for bucket_end in sorted(by_bucket):
                if start <= bucket_end < stop:
                    values = sorted(by_bucket[bucket_end])
                    pts.append((bucket_end, values[max(1, math.ceil(0.99 * len(values))) - 1]))
            if pts:
                out[instance] = pts
        return out
