"""What there is to read: instances, runs, scrape targets and their health, series names."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import select

from collector.queries._base import Db, _bound
from collector.queries.timeseries import parse_labels
from collector.redact import redact_url
from collector.schema import (
    Instance,
    Run,
    ScrapeTarget,
)
from collector.series import list_series_names as _list_series_names

# Instances the tuner stores its replays under (`tuner-sim` for the simulator, `tuner-engine` for an in-process
# engine): traffic no user sent. Serving views leave them out unless asked, and rules never page for them.
SIMULATED_INSTANCE_PREFIX = "tuner-"


def is_simulated_instance(name: str) -> bool:
    return name.startswith(SIMULATED_INSTANCE_PREFIX)


def list_series_names() -> list[str]:
    """Every canonical series name `series_points` answers for."""
    return _list_series_names()


# --- instances, runs, targets ----------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceInfo:
    """An instance, whichever way its data arrives: `push` (engine events) and/or `scrape` (a target).

    `jobs` and `labels` come from the scrape targets that name it (static target labels such as `node`).
    """

    name: str
    first_seen_ts: float
    last_seen_ts: float
    sources: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


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
    labels: dict[str, str] = field(default_factory=dict)
    sample_limit: int = 0


def list_instances(db: Db) -> list[InstanceInfo]:
    """Every instance that pushed events or is (or was) scraped, by name, with where its data comes from."""
    t, r, st = Instance.__table__, Run.__table__, ScrapeTarget.__table__
    with _bound(db) as conn:
        seen = {
            name: (first, last)
            for name, first, last in conn.execute(select(t.c.name, t.c.first_seen_ts, t.c.last_seen_ts))
        }
        pushed = set(conn.execute(select(r.c.instance).distinct()).scalars())
        targets = conn.execute(select(st.c.instance, st.c.job, st.c.labels, st.c.created_at, st.c.last_scrape_at)).all()
    jobs: dict[str, set[str]] = defaultdict(set)
    labels: dict[str, dict[str, str]] = defaultdict(dict)
    for instance, job, stored, created_at, last_scrape_at in targets:
        jobs[instance].add(job)
        labels[instance].update(parse_labels(stored))
        if instance not in seen:
            seen[instance] = (created_at, last_scrape_at or created_at)
    out = []
    for name in sorted(seen):
        sources = tuple(s for s, has in (("push", name in pushed), ("scrape", name in jobs)) if has)
        first, last = seen[name]
        out.append(InstanceInfo(name, first, last, sources, tuple(sorted(jobs.get(name, ()))), labels.get(name, {})))
    return out


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
        t.c.labels,
        t.c.sample_limit,
    ).order_by(t.c.id)
    with _bound(db) as conn:
        rows = conn.execute(stmt).all()
    # The URL as shown (collector.redact): only the scraper reads the credentials it may carry.
    return [
        TargetHealth(
            r.id,
            redact_url(r.url),
            r.job,
            r.instance,
            r.up,
            r.last_error,
            r.last_scrape_at,
            r.scrape_duration_s,
            r.interval_s,
            r.enabled,
            labels=dict(parse_labels(r.labels)),
            sample_limit=int(r.sample_limit),
        )
        for r in rows
    ]
