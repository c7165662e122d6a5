"""The values expressions compute (label sets, instant vectors, sample lists), the source they are read from,
and the error evaluation raises.

A label set is a tuple of (name, value) pairs sorted by name, so equal sets are equal tuples and can key a
dict. Label values are never empty (Prometheus: an empty value is the label's absence). The series name is
the label `__name__`; sources never return it, the selection adds it and arithmetic drops it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]
Points = list[tuple[float, float]]
NAME = "__name__"
STALE_NAN = struct.unpack(">d", bytes.fromhex("7ff0000000000002"))[0]
_STALE_BITS = b"\x7f\xf0\x00\x00\x00\x00\x00\x02"


@runtime_checkable
class SeriesSource(Protocol):
    def points(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, Points]:
        """Samples of canonical series `name` with start <= ts <= end, one entry per label set, oldest first.

        A label set is sorted (name, value) pairs with an `instance` and never `__name__`; `instances`
        is a hint: the caller filters again, a source may return more.
        """


@runtime_checkable
class LatestSource(Protocol):
    def latest(
        self, name: str, start: float, end: float, instances: Sequence[str] | None = None
    ) -> dict[Labels, tuple[float, float]]:
        """The newest sample (ts, value) of each label set of `name` with start <= ts <= end: all an instant
        selector reads. The same label sets and `instances` hint as `SeriesSource.points`; a source without it is
        read through `points`."""


def newest_points(series: dict[Labels, Points]) -> dict[Labels, tuple[float, float]]:
    """Each label set's newest sample: `LatestSource.latest` from what `SeriesSource.points` returned."""
    return {labels: pts[-1] for labels, pts in series.items() if pts}


class EvalError(RuntimeError):
    """An expression that parsed but cannot be computed on this data (e.g. duplicate label sets)."""


def is_stale(value: float) -> bool:
    return math.isnan(value) and struct.pack(">d", value) == _STALE_BITS


def drop_name(labels: Labels) -> Labels:
    return tuple(p for p in labels if p[0] != NAME)


def with_name(name: str, labels: Labels) -> Labels:
    """`labels` plus `__name__`, still sorted ("__name__" sorts after upper-case names such as DCGM's `UUID`)."""
    if not labels or labels[0][0] > NAME:
        return ((NAME, name), *labels)
    return tuple(sorted(((NAME, name), *labels)))


def labels_dict(labels: Labels) -> dict[str, str]:
    return dict(labels)


def as_labels(pairs: dict[str, str]) -> Labels:
    """A label set from a mapping: sorted, empty values dropped (they mean the label is absent)."""
    return tuple(sorted((k, v) for k, v in pairs.items() if v != ""))
