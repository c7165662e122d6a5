"""Series selection: one entry per stored label set, filtered by the selector's matchers.

Matchers apply to any label as Prometheus's do: `=`/`!=` compare the value (an absent label is ""), `=~`/`!~`
match the fully anchored regular expression, with RE2 semantics in linear time as Prometheus's
(alerts.regex). An exact `instance="..."` is also pushed down to the source. The selector's name may be
external (`DCGM_FI_DEV_FB_USED`): the source is asked for the canonical series (alerts.series_catalog.resolve)
and values come back in the written name's unit; `__name__` is the name as written.

An instant selector needs each series' newest sample of the lookback and no other: a source that can say just
that (`LatestSource`: the collector's database, one index probe per engine) is asked for it, not for every
sample of the five minutes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

from alerts.expr_ast import Matcher, MatrixSelector, VectorSelector
from alerts.expr_values import (
    NAME,
    Labels,
    LatestSource,
    Points,
    SeriesSource,
    Vector,
    is_stale,
    newest_points,
    with_name,
)
from alerts.matchers import label_matches
from alerts.series_catalog import resolve

T = TypeVar("T")


def fetch(source: SeriesSource, sel: VectorSelector, start: float, end: float) -> list[tuple[Labels, Points]]:
    """The selector's series with samples in [start, end], in the written name's unit."""
    resolved = resolve(sel.name)
    raw = source.points(resolved.canonical, start, end, _instance_hint(sel))
    out = _selected(sel, raw.items())
    if resolved.scale != 1.0:
        out = [(labels, _unscaled(pts, resolved.scale)) for labels, pts in out]
    return out


def newest(source: SeriesSource, sel: VectorSelector, t: float, lookback_s: float) -> list[tuple[Labels, float, float]]:
    """(labels, ts, value) of each selected series' newest sample in (t - lookback, t], stale markers included,
    in the written name's unit. A `LatestSource` is asked for those samples alone (one per series, not every
    sample of the lookback); any other source is read through `points`."""
    resolved = resolve(sel.name)
    args = (resolved.canonical, t - lookback_s, t, _instance_hint(sel))
    raw = source.latest(*args) if isinstance(source, LatestSource) else newest_points(source.points(*args))
    out: list[tuple[Labels, float, float]] = []
    for labels, (pt, value) in _selected(sel, raw.items()):
        if t - lookback_s < pt <= t:
            if resolved.scale != 1.0:
                [(pt, value)] = _unscaled([(pt, value)], resolved.scale)
            out.append((labels, pt, value))
    return out


def instant(source: SeriesSource, sel: VectorSelector, ts: float, lookback_s: float) -> Vector:
    """The newest sample in (t - lookback, t] of each series, unless that sample is a stale marker."""
    found = newest(source, sel, ts - sel.offset_s, lookback_s)
    return {with_name(sel.name, labels): value for labels, _, value in found if not is_stale(value)}


def instant_timestamps(source: SeriesSource, sel: VectorSelector, ts: float, lookback_s: float) -> Vector:
    """timestamp(selector): the time of the sample `instant` would pick, the name dropped."""
    found = newest(source, sel, ts - sel.offset_s, lookback_s)
    return {labels: pt for labels, pt, value in found if not is_stale(value)}


def _instance_hint(sel: VectorSelector) -> list[str] | None:
    """An exact `instance="..."` matcher, pushed down to the source."""
    exact = [m.value for m in sel.matchers if m.label == "instance" and m.op == "="]
    return exact[:1] if exact else None


def _selected(sel: VectorSelector, found: Iterable[tuple[Labels, T]]) -> list[tuple[Labels, T]]:
    matchers = sel.matchers
    return [(labels, got) for labels, got in found if not matchers or _all_match(matchers, sel.name, labels)]


def matrix(source: SeriesSource, node: MatrixSelector, ts: float) -> list[tuple[Labels, Points, list[float]]]:
    """Samples in the closed range [t - range, t] of each series, stale markers left out, and their values."""
    sel = node.selector
    end = ts - sel.offset_s
    start = end - node.range_s
    result = []
    for labels, pts in fetch(source, sel, start, end):
        if not pts:
            continue
        values = [v for _, v in pts]
        if math.isnan(sum(values)) or pts[0][0] < start or pts[-1][0] > end:  # rare: filter point by point
            pts = [(t, v) for t, v in pts if start <= t <= end and not is_stale(v)]
            if not pts:
                continue
            values = [v for _, v in pts]
        result.append((with_name(sel.name, labels), pts, values))
    return result


def _all_match(matchers: tuple[Matcher, ...], name: str, labels: Labels) -> bool:
    present = dict(labels)
    present[NAME] = name
    return all(label_matches(m.op, m.value, present.get(m.label, "")) for m in matchers)


def _unscaled(pts: Points, scale: float) -> Points:
    """Stored values back in the external unit. A power-of-two scale (MiB) divides exactly; any other
    (percent: 0.01) is rounded to 15 significant digits, so a value the exporter reported comes back as
    written (70 * 0.01 / 0.01 would be 70.00000000000001) and a threshold in the rule compares exactly."""
    if math.frexp(scale)[0] == 0.5:
        return [(t, v if is_stale(v) else v / scale) for t, v in pts]
    return [(t, v if is_stale(v) else float(f"{v / scale:.15g}")) for t, v in pts]
