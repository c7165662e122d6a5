"""Mapping one scrape: external (name, labels, value) samples -> canonical points with identifying labels.

The tables (canonical names, sources, external mappings) live in collector.series; this module applies
them: which labels a point keeps, how `le` is written, derived labels, and the memory totals DCGM does
not expose (used + free + reserved, per label set).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from collector.series import BY_EXTERNAL, FAMILY_RANK, SOURCE_LABELS, Labels, Mapping

# --- mapping a scrape ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One canonical sample: `labels` are its identifying labels (not yet the target's static ones)."""

    name: str
    labels: Labels
    value: float

    @property
    def labels_json(self) -> str:
        return labels_json(self.labels)


def labels_json(labels: Labels) -> str:
    """The stored form of a label set: sorted compact JSON, so equal sets compare equal in SQL."""
    return json.dumps(dict(sorted(labels.items())), separators=(",", ":"))


def format_le(bound: float) -> str:
    """A bucket bound as Prometheus writes it: Go's `strconv.FormatFloat(bound, 'g', -1, 64)`.

    The shortest digits that read back as the same float, in exponent form below 1e-4 and from 1e+06 up,
    with no trailing ".0": "0.1", "1", "2560", "1e+06", "+Inf". Exporters disagree on the text (Python's
    client writes "1.0", Go's "1"), so every `le` is parsed as a float, scaled to base units, and written
    again by this one rule; equal bounds then compare equal whatever exporter or unit they came from.
    """
    if math.isnan(bound):
        return "NaN"
    if math.isinf(bound):
        return "+Inf" if bound > 0 else "-Inf"
    if bound == 0:
        return "0"
    sign, digits, exp = Decimal(repr(bound)).normalize().as_tuple()
    exponent = int(exp)  # finite here, so an int
    text = "".join(map(str, digits))
    sci = len(digits) - 1 + exponent
    if sci < -4 or sci >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        out = f"{mantissa}e{'-' if sci < 0 else '+'}{abs(sci):02d}"
    elif exponent >= 0:
        out = text + "0" * exponent
    elif -exponent >= len(text):
        out = "0." + "0" * (-exponent - len(text)) + text
    else:
        out = text[:exponent] + "." + text[exponent:]
    return ("-" if sign else "") + out


def _identity(mapping: Mapping, labels: Labels) -> dict[str, str] | None:
    """The identifying labels of one external sample; None when a bucket has no readable `le`."""
    rule = SOURCE_LABELS[mapping.source]
    kept: dict[str, str] = {}
    for name, value in labels.items():
        stored = rule.rename.get(name, name)
        if stored in rule.keep or stored in mapping.keep_labels:
            if stored == name:
                kept[stored] = value
            else:
                kept.setdefault(stored, value)  # the stored spelling wins when both are present
    if mapping.le_scale is not None:
        try:
            bound = float(labels["le"]) * mapping.le_scale
        except (KeyError, ValueError):
            return None
        kept["le"] = format_le(bound)
    if mapping.derive is not None:
        kept[mapping.derive.target] = mapping.derive.value(labels)
    return kept


def _family(mapping: Mapping) -> str:
    """The canonical family: a histogram's base name (`ttft_seconds`), else the series name."""
    return mapping.canonical.rsplit("_", 1)[0] if mapping.origin != mapping.external else mapping.canonical


def map_samples(samples: Iterable[tuple[str, Labels, float]]) -> list[Point]:
    """External (name, labels, value) samples of one scrape -> canonical points, one per stored series.

    Unknown names and NaN values are skipped. See MAPPINGS for which family wins when two land on one
    series. DCGM usually reports used, free and reserved but not total, so total is derived as their sum,
    strictly per label set (a MIG instance's total is never another instance's or the whole GPU's).
    """
    candidates: list[tuple[Mapping, Point]] = []
    best: dict[tuple[str, str], int] = {}
    for name, labels, value in samples:
        mapping = BY_EXTERNAL.get(name)
        if mapping is None or value != value:  # unknown or NaN
            continue
        kept = _identity(mapping, labels)
        if kept is None:
            continue
        point = Point(mapping.canonical, kept, value * mapping.scale)
        candidates.append((mapping, point))
        key = (_family(mapping), labels_json({k: v for k, v in kept.items() if k != "le"}))
        best[key] = min(best.get(key, FAMILY_RANK[mapping.origin]), FAMILY_RANK[mapping.origin])
    points: dict[tuple[str, str], Point] = {}
    for mapping, point in candidates:
        key = (_family(mapping), labels_json({k: v for k, v in point.labels.items() if k != "le"}))
        if FAMILY_RANK[mapping.origin] == best[key]:
            points.setdefault((point.name, point.labels_json), point)  # a repeated sample: the first stays
    return _with_memory_totals(list(points.values()))


_MEMORY_PARTS = ("memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes", "memory_total_bytes")


def _with_memory_totals(points: list[Point]) -> list[Point]:
    by_set: dict[str, dict[str, Point]] = {}
    for p in points:
        if p.name in _MEMORY_PARTS:
            by_set.setdefault(p.labels_json, {})[p.name] = p
    for parts in by_set.values():
        if "memory_total_bytes" not in parts and {"memory_used_bytes", "memory_free_bytes"} <= parts.keys():
            used = parts["memory_used_bytes"]
            reserved = parts["memory_reserved_bytes"].value if "memory_reserved_bytes" in parts else 0.0
            total = used.value + parts["memory_free_bytes"].value + reserved
            points.append(Point("memory_total_bytes", used.labels, total))
    return points
