"""Prometheus durations (`30s`, `5m`, `1h30m`, `1d`, `1w`, `1y`, `250ms`) as float seconds.

Same grammar as Prometheus's model.ParseDuration: units in descending order, each at most once, integers
only; a bare `0` is allowed. Anything else raises `DurationError` naming the text.
"""

from __future__ import annotations

import re

_UNITS = (
    ("y", 365 * 86400.0),
    ("w", 7 * 86400.0),
    ("d", 86400.0),
    ("h", 3600.0),
    ("m", 60.0),
    ("s", 1.0),
    ("ms", 0.001),
)
_PATTERN = re.compile("^" + "".join(rf"(?:(\d+){u})?" for u, _ in _UNITS) + "$")


class DurationError(ValueError):
    """A duration string that Prometheus would reject too."""


def parse_duration(text: object) -> float:
    """Seconds of a Prometheus duration; numbers (and any non-string) are refused so that `for: 5` is not silently 5
    seconds."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise DurationError(f"duration must be a string like '5m', got {text!r}")
    if text == "0":
        return 0.0
    match = _PATTERN.match(text)
    if not text or match is None or not any(match.groups()):
        raise DurationError(f"not a valid duration string: {text!r} (use e.g. 30s, 5m, 1h30m, 1d)")
    return sum(int(g) * mult for g, (_, mult) in zip(match.groups(), _UNITS, strict=True) if g)


def format_duration(seconds: float) -> str:
    """The shortest Prometheus spelling of `seconds` (what promtool and the export print)."""
    if seconds == 0:
        return "0s"
    ms_total = round(seconds * 1000)
    out = []
    for unit, mult in _UNITS:
        unit_ms = round(mult * 1000)
        count, ms_total = divmod(ms_total, unit_ms)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)
