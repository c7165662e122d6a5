"""What the demo knows about its alert: whether it fired and resolved (from what the webhook sink
received), and when it did not, why — which figure stayed under which threshold for how long, read
from the stored series through `collector.queries` as the rule itself reads them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ALERT = "MemoryPressure"
INSTANCE = "demo-engine"
# alerts/rules/demo.yml: `memory_usage > 0.9 or kv_usage > 0.9` (a test keeps the two in step).
THRESHOLD = 0.9
FIGURES = ("kv_usage", "memory_usage")


def _mine(alert: dict[str, Any], name: str, instance: str | None) -> bool:
    labels = alert.get("labels", {})
    return labels.get("alertname") == name and (instance is None or labels.get("instance") == instance)


def alert_states(payloads: Sequence[dict[str, Any]], name: str = ALERT, instance: str | None = INSTANCE) -> list[str]:
    """The alert's status in each notification that carried it, in arrival order (of `instance` only:
    the tuner's simulated trials are stored in the same database and may trip the same rule)."""
    return [a["status"] for p in payloads for a in p.get("alerts", []) if _mine(a, name, instance)]


def fired(payloads: Sequence[dict[str, Any]], name: str = ALERT, instance: str | None = INSTANCE) -> bool:
    return "firing" in alert_states(payloads, name, instance)


def resolved(payloads: Sequence[dict[str, Any]], name: str = ALERT, instance: str | None = INSTANCE) -> bool:
    """Fired, and the last word on it is `resolved`."""
    states = alert_states(payloads, name, instance)
    return "firing" in states and states[-1] == "resolved"


def history(payloads: Sequence[dict[str, Any]], name: str = ALERT, instance: str | None = INSTANCE) -> str:
    """`fired N times (first at T), resolved at T` from the notifications (each firing episode has its own
    startsAt; a notification repeats the alerts of its group)."""
    alerts = [a for p in payloads for a in p.get("alerts", []) if _mine(a, name, instance)]
    if not alerts:
        return f"{name}: no notification"
    starts = sorted({a["startsAt"] for a in alerts})
    last = alerts[-1]
    times = "once" if len(starts) == 1 else f"{len(starts)} times"
    text = f"{name} {{instance={instance}}}: fired {times} (first at {starts[0]})"
    return text + (f", resolved at {last['endsAt']}" if last["status"] == "resolved" else ", still firing")


def wait_until(check: Callable[[], bool], *, timeout_s: float, stop: Callable[[], bool], poll_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if stop() or time.monotonic() >= deadline:
            return check()
        time.sleep(poll_s)
    return True


@dataclass(frozen=True)
class Stretch:
    """How a series stood against a threshold: its peak, the longest time it stayed above, its last value."""

    figure: str
    samples: int
    peak: float | None = None
    longest_above_s: float = 0.0
    last: float | None = None


def stretch(figure: str, points: Sequence[tuple[float, float]], threshold: float) -> Stretch:
    """The longest run of consecutive samples above `threshold`, from its first sample to its last
    (what a rule's `for` has to see held between evaluations)."""
    if not points:
        return Stretch(figure, 0)
    longest = 0.0
    run_start: float | None = None
    for ts, value in points:
        if value > threshold:
            run_start = ts if run_start is None else run_start
            longest = max(longest, ts - run_start)
        else:
            run_start = None
    return Stretch(figure, len(points), max(v for _, v in points), longest, points[-1][1])


def read_stretches(
    db_url: str, *, instance: str, start: float, end: float, threshold: float = THRESHOLD
) -> list[Stretch]:
    from collector.db import make_engine
    from collector.queries import series_points

    engine = make_engine(db_url)
    try:
        out = []
        for figure in FIGURES:
            series = series_points(engine, name=figure, start=start, end=end, instances=(instance,))
            points = sorted(p for pts in series.values() for p in pts)
            out.append(stretch(figure, points, threshold))
        return out
    finally:
        engine.dispose()


def why_not_fired(stretches: Sequence[Stretch], *, threshold: float, for_s: float) -> str:
    """One sentence: why the alert did not fire, from what the figures did."""
    seen = [s for s in stretches if s.samples]
    if not seen:
        return f"no {' or '.join(FIGURES)} samples were stored, so the rule had nothing to see"
    best = max(seen, key=lambda s: (s.longest_above_s, s.peak or 0.0))
    if best.peak is not None and best.peak <= threshold:
        return f"{best.figure} peaked at {best.peak:.3f}, never above the rule's {threshold:g}"
    if best.longest_above_s < for_s:
        return (
            f"{best.figure} was above {threshold:g} for at most {best.longest_above_s:.1f} s in a row "
            f"(peak {best.peak:.3f}), under the rule's for: {for_s:g}s"
        )
    return (
        f"{best.figure} held above {threshold:g} for {best.longest_above_s:.1f} s (for: {for_s:g}s) but no firing "
        "notification reached the webhook sink: see `kvpilot alerts deliveries`"
    )


def why_not_resolved(stretches: Sequence[Stretch], *, threshold: float) -> str:
    high = [s for s in stretches if s.last is not None and s.last > threshold]
    if high:
        return ", ".join(f"{s.figure} was still at {s.last:.3f} (above {threshold:g})" for s in high)
    return "the figures fell back under the threshold but no resolved notification reached the webhook sink"
