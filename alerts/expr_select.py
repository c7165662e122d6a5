"""Series selection: one entry per stored label set, filtered by the selector's matchers.

Matchers apply to any label as Prometheus's do: `=`/`!=` compare the value (an absent label is ""), `=~`/`!~`
match the fully anchored regular expression, with RE2 semantics in linear time as Prometheus's
(alerts.regex). An exact `instance="..."` is also pushed down to the source. The selector's name may be
external (`DCGM_FI_DEV_FB_USED`): the source is asked for the canonical series (alerts.series_catalog.resolve)
and values come back in the written name's unit; `__name__` is the name as written.
"""

from __future__ import annotations

import math

from alerts.expr_ast import Matcher, MatrixSelector, VectorSelector
from alerts.expr_values import NAME, Labels, Points, SeriesSource, Vector, is_stale, with_name
from alerts.matchers import label_matches
from alerts.series_catalog import resolve


def fetch(source: SeriesSource, sel: VectorSelector, start: float, end: float) -> list[tuple[Labels, Points]]:
    """The selector's series with samples in [start, end], in the written name's unit."""
    resolved = resolve(sel.name)
    exact = [m.value for m in sel.matchers if m.label == "instance" and m.op == "="]
    raw = source.points(resolved.canonical, start, end, exact[:1] if exact else None)
    matchers = sel.matchers
    out = [(labels, pts) for labels, pts in raw.items() if not matchers or _all_match(matchers, sel.name, labels)]
    if resolved.scale != 1.0:
        out = [(labels, _unscaled(pts, resolved.scale)) for labels, pts in out]
    return out


def instant(source: SeriesSource, sel: VectorSelector, ts: float, lookback_s: float) -> Vector:
    """The newest sample in (t - lookback, t] of each series, unless that sample is a stale marker."""
    t = ts - sel.offset_s
    out: Vector = {}
    for labels, pts in fetch(source, sel, t - lookback_s, t):
        for pt_ts, value in reversed(pts):
            if t - lookback_s < pt_ts <= t:
                if not is_stale(value):
                    out[with_name(sel.name, labels)] = value
                break
    return out


def instant_timestamps(source: SeriesSource, sel: VectorSelector, ts: float, lookback_s: float) -> Vector:
    """timestamp(selector): the time of the sample `instant` would pick, the name dropped."""
    t = ts - sel.offset_s
    out: Vector = {}
    for labels, pts in fetch(source, sel, t - lookback_s, t):
        for pt_ts, value in reversed(pts):
            if t - lookback_s < pt_ts <= t:
                if not is_stale(value):
                    out[labels] = pt_ts
                break
    return out


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
