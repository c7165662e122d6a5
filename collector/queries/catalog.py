"""What there is to read: instances, runs, scrape targets and their health, series names."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from collector.queries._base import Db, _bound
from collector.schema import (
    Instance,
    Run,
    ScrapeTarget,
)
from collector.series import list_series_names as _list_series_names


def list_series_names() -> list[str]:
    """Every canonical series name `series_points` answers for."""
    return _list_series_names()


# --- instances, runs, targets ----------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceInfo:
    name: str
    first_seen_ts: float
    last_seen_ts: float


@dataclass(frozen=True)
class RunInfo:
    instance: str
    run_id: str
    first_seen_ts: float
    last_seen_ts: float


@dataclass(frozen=True)
class TargetHealth:
    id: int
    url: str
    job: str
    instance: str
    up: bool | None
    last_error: str | None
    last_scrape_at: float | None
    scrape_duration_s: float | None
    interval_s: float
    enabled: bool


def list_instances(db: Db) -> list[InstanceInfo]:
    t = Instance.__table__
    with _bound(db) as conn:
        rows = conn.execute(select(t.c.name, t.c.first_seen_ts, t.c.last_seen_ts).order_by(t.c.name)).all()
    return [InstanceInfo(*r) for r in rows]


def list_runs(db: Db, *, instance: str | None = None) -> list[RunInfo]:
    t = Run.__table__
    stmt = select(t.c.instance, t.c.run_id, t.c.first_seen_ts, t.c.last_seen_ts)
    if instance is not None:
        stmt = stmt.where(t.c.instance == instance)
    with _bound(db) as conn:
        rows = conn.execute(stmt.order_by(t.c.last_seen_ts.desc(), t.c.instance, t.c.run_id)).all()
    return [RunInfo(*r) for r in rows]


def target_health(db: Db) -> list[TargetHealth]:
    t = ScrapeTarget.__table__
    stmt = select(
        t.c.id,
        t.c.url,
        t.c.job,
        t.c.instance,
        t.c.up,
        t.c.last_error,
        t.c.last_scrape_at,
        t.c.scrape_duration_s,
        t.c.interval_s,
        t.c.enabled,
    ).order_by(t.c.id)
    with _bound(db) as conn:
        return [TargetHealth(*r) for r in conn.execute(stmt).all()]
