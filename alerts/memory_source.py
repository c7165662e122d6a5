"""An in-memory `SeriesSource`: what promtool-format tests and benchmarks evaluate against.

A series is (name, label set); the label set always holds `instance`. `add(name, instance, ts, value)`
keeps working for one series per instance; `labels=` adds the others (gpu, model_name, ...).
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Sequence

from alerts.expr_values import Labels, Points, as_labels

_Series = tuple[list[float], list[float]]


class MemorySource:
    def __init__(self) -> None:
        # name -> instance -> label set -> (times, values): the instance level serves the pushdown
        self._series: dict[str, dict[str, dict[Labels, _Series]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, instance: str, ts: float, value: float, labels: dict[str, str] | None = None) -> None:
        with self._lock:
            times, values = self._get(name, instance, labels)
            if times and ts < times[-1]:
                index = bisect.bisect_right(times, ts)
                times.insert(index, ts)
                values.insert(index, value)
            else:
                times.append(ts)
                values.append(value)

    def add_many(
        self,
        name: str,
        instance: str,
        points: Sequence[tuple[float, float]],
        labels: dict[str, str] | None = None,
    ) -> None:
        new_times = [ts for ts, _ in points]
        with self._lock:
            times, values = self._get(name, instance, labels)
            in_order = all(map(operator.le, new_times, new_times[1:]))
            if in_order and (not times or not new_times or new_times[0] >= times[-1]):
                times.extend(new_times)
                values.extend([value for _, value in points])
                return
        for ts, value in points:
            self.add(name, instance, ts, value, labels)

    def _get(self, name: str, instance: str, labels: dict[str, str] | None) -> _Series:
        key = (
            as_labels({**(labels or {}), "instance": instance}) if labels or not instance else (("instance", instance),)
        )
        by_labels = self._series.setdefault(name, {}).setdefault(instance, {})
        series = by_labels.get(key)
        if series is None:
            series = by_labels[key] = ([], [])
        return series

    def names(self) -> list[str]:
        return sorted(self._series)

    def points(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, Points]:
        with self._lock:
            by_instance = self._series.get(name, {})
            wanted = by_instance.keys() if instances is None else [i for i in instances if i in by_instance]
            out: dict[Labels, Points] = {}
            for instance in wanted:
                for labels, (times, values) in by_instance[instance].items():
                    lo = bisect.bisect_left(times, start)
                    hi = bisect.bisect_right(times, end)
                    if hi > lo:
                        out[labels] = list(zip(times[lo:hi], values[lo:hi], strict=True))
            return out
