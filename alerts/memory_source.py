"""An in-memory `SeriesSource`: what promtool-format tests and benchmarks evaluate against."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from alerts.expr_eval import Points


class MemorySource:
    def __init__(self) -> None:
        self._series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, instance: str, ts: float, value: float) -> None:
        with self._lock:
            times, values = self._series.setdefault(name, {}).setdefault(instance, ([], []))
            if times and ts < times[-1]:
                index = bisect.bisect_right(times, ts)
                times.insert(index, ts)
                values.insert(index, value)
            else:
                times.append(ts)
                values.append(value)

    def add_many(self, name: str, instance: str, points: Sequence[tuple[float, float]]) -> None:
        for ts, value in points:
            self.add(name, instance, ts, value)

    def names(self) -> list[str]:
        return sorted(self._series)

    def points(self, name: str, start: float, end: float, instances: Sequence[str] | None = None) -> dict[str, Points]:
        with self._lock:
            by_instance = self._series.get(name, {})
            wanted = by_instance.keys() if instances is None else [i for i in instances if i in by_instance]
            out: dict[str, Points] = {}
            for instance in wanted:
                times, values = by_instance[instance]
                lo = bisect.bisect_left(times, start)
                hi = bisect.bisect_right(times, end)
                if hi > lo:
                    out[instance] = list(zip(times[lo:hi], values[lo:hi], strict=True))
            return out
