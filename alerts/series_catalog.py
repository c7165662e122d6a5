"""Which series names rule expressions may use, and what an external name reads.

Canonical names (collector.series.CANONICAL) plus alerts' derived ones. `ttft_p99_seconds` is not a stored
series: the SQL source computes the p99 per minute from per-request events (alerts.sql_source). A
histogram's buckets are `<base>_bucket` (label `le`) wherever `<base>_count` is canonical.

External names (`vllm:num_requests_waiting`, `DCGM_FI_DEV_FB_USED`, `kvpilot_kv_usage`) resolve through the
scraper's own mapping (collector.series.BY_EXTERNAL) to the canonical series they are stored as, with the
mapping's scale: see `resolve`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cache

from collector.series import BY_EXTERNAL, CANONICAL

DERIVED_SERIES: dict[str, str] = {
    "ttft_p99_seconds": (
        "p99 of time to first token over the requests finished in each minute, from the HTTP arrival (user-facing)"
    ),
}
_BUCKET, _COUNT = "_bucket", "_count"


@dataclass(frozen=True, slots=True)
class Resolved:
    canonical: str
    scale: float = 1.0  # stored value = value in the written name's unit * scale


@cache
def known_series() -> frozenset[str]:
    buckets = {n[: -len(_COUNT)] + _BUCKET for n in CANONICAL if n.endswith(_COUNT)}
    return frozenset(CANONICAL) | frozenset(DERIVED_SERIES) | frozenset(buckets)


@cache
def external_names() -> dict[str, Resolved]:
    """Every external name a rule may use, with the canonical series it reads (histogram buckets included)."""
    out = {name: Resolved(m.canonical, m.scale) for name, m in BY_EXTERNAL.items()}
    for name, m in BY_EXTERNAL.items():
        if name.endswith(_COUNT) and m.canonical.endswith(_COUNT):
            bucket = name[: -len(_COUNT)] + _BUCKET
            out.setdefault(bucket, Resolved(m.canonical[: -len(_COUNT)] + _BUCKET, m.scale))
    return out


@cache
def resolve(name: str) -> Resolved:
    """The stored series that a selector `name` reads: itself when canonical, else its external mapping.

    Unknown names resolve to themselves (a `MemorySource` in tests needs no catalog); rule files are
    validated with `unknown_series_hint` before they ever reach the evaluator.
    """
    if name in known_series():
        return Resolved(name)
    return external_names().get(name, Resolved(name))


def is_known(name: str) -> bool:
    return name in known_series() or name in external_names()


def unknown_series_hint(name: str) -> str:
    """'; did you mean ...?' for an unknown name, naming the canonical series behind any external suggestion."""
    external = external_names()
    close = difflib.get_close_matches(name, sorted(known_series() | external.keys()), n=3)
    if not close:
        return "; see `kvpilot alerts check --list-series`"
    shown = [f"{c} (canonical {external[c].canonical})" if c in external else c for c in close]
    return f"; did you mean {', '.join(shown)}?"


def series_kind(name: str) -> str:
    """'gauge' or 'counter' (derived series are gauges; buckets count)."""
    name = resolve(name).canonical
    if name.endswith(_BUCKET):
        return "counter"
    canonical = CANONICAL.get(name)
    return canonical.kind if canonical is not None else "gauge"
