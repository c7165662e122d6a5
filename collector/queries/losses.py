"""Telemetry the engines lost before the collector stored it, from the sinks' `gap` records.

The counter over time is `events_lost_total{kind, reason}` (collector.queries.timeseries, what the rules
read); this is the window's total, for the dashboard's loss notice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select

from collector.queries._base import Db, _bound
from collector.schema import GapRow


@dataclass(frozen=True)
class LostEvents:
    instance: str
    kind: str
    reason: str
    events: int
    first_ts: float  # the lost events' own time span
    last_ts: float


def lost_events(
    db: Db, *, start: float, end: float, instances: Sequence[str] | None = None, run_id: str | None = None
) -> list[LostEvents]:
    """Per (instance, kind, reason): events lost whose time span overlaps [start, end), largest first.

    A record counts whole when its span overlaps the window (a sink does not know which of the lost
    events fell where), so its span may reach past the window's edges.
    """
    g = GapRow.__table__
    stmt = (
        select(g.c.instance, g.c.kind, g.c.reason, func.sum(g.c.events), func.min(g.c.first_ts), func.max(g.c.last_ts))
        .where(g.c.first_ts < end, g.c.last_ts >= start)
        .group_by(g.c.instance, g.c.kind, g.c.reason)
    )
    if instances is not None:
        stmt = stmt.where(g.c.instance.in_(instances))
    if run_id is not None:
        stmt = stmt.where(g.c.run_id == run_id)
    with _bound(db) as conn:
        rows = [LostEvents(i, k, r, int(n), float(lo), float(hi)) for i, k, r, n, lo, hi in conn.execute(stmt)]
    return sorted(rows, key=lambda r: (-r.events, r.instance, r.kind, r.reason))
