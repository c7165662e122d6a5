"""Which engine an instance runs, and whether its prefix cache is on: what advice must know to name the
engine's own knobs (vLLM's `--enable-prefix-caching`, kvpilot's `cache.enable_prefix_cache`).

Read from what is stored, best signal first: vLLM's `cache_config_info` (scraped; its labels carry
`enable_prefix_caching`), the job of the instance's scrape target (`kvpilot vllm serve` registers job
`vllm`), and the event kinds only kvpilot's own engine pushes (samples, the allocation trace). An instance
none of them names is `None`: advice then names every engine's knob rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import func, select

from collector.queries._base import Db, _bound
from collector.queries.timeseries import parse_labels
from collector.schema import AllocRow, SampleRow, ScrapeTarget, SeriesPoint

EngineName = Literal["kvpilot", "vllm", "sglang"]
ENGINES: tuple[EngineName, ...] = ("kvpilot", "vllm", "sglang")
CONFIG_SERIES = "kv_cache_config_info"  # vLLM's cache_config_info, one label set per engine core


@dataclass(frozen=True)
class EngineInfo:
    """`engine` None: the stored data does not say. `prefix_caching` None: not known (not reported)."""

    instance: str
    engine: EngineName | None
    prefix_caching: bool | None
    told_by: str  # what said so, for the reader ("vLLM's cache_config_info", "scrape target job vllm", ...)


def engine_infos(db: Db, *, instances: Sequence[str]) -> dict[str, EngineInfo]:
    """One EngineInfo per instance asked for."""
    names = sorted(set(instances))
    if not names:
        return {}
    sp, st, sa, al = SeriesPoint.__table__.c, ScrapeTarget.__table__.c, SampleRow.__table__.c, AllocRow.__table__.c
    newest = (
        select(sp.instance, func.max(sp.ts).label("ts"))
        .where(sp.name == CONFIG_SERIES, sp.instance.in_(names))
        .group_by(sp.instance)
        .subquery()
    )
    with _bound(db) as conn:
        configs = conn.execute(
            select(sp.instance, sp.labels)
            .join(newest, (sp.instance == newest.c.instance) & (sp.ts == newest.c.ts))
            .where(sp.name == CONFIG_SERIES)
        ).all()
        jobs = conn.execute(select(st.instance, st.job).where(st.instance.in_(names))).all()
        sampled = conn.execute(
            select(sa.instance, func.count(sa.prefix_hit_rate)).where(sa.instance.in_(names)).group_by(sa.instance)
        ).all()
        traced = set(conn.execute(select(al.instance).where(al.instance.in_(names)).distinct()).scalars())
    out: dict[str, EngineInfo] = {}
    for name in names:
        out[name] = EngineInfo(name, None, None, "nothing stored names the engine")
    for name, hit_rates in sampled:  # a hit rate is reported only with the prefix cache on
        out[name] = EngineInfo(name, "kvpilot", bool(hit_rates) or None, "kvpilot's sample events")
    for name in traced:
        if out[name].engine is None:
            out[name] = EngineInfo(name, "kvpilot", None, "kvpilot's allocation trace")
    for name, job in jobs:
        if job in ENGINES and out[name].engine is None:
            out[name] = EngineInfo(name, job, None, f"scrape target job {job}")
    said: dict[str, set[str]] = {}
    for name, labels in configs:
        said.setdefault(name, set()).add(dict(parse_labels(labels)).get("enable_prefix_caching", "").lower())
    for name, values in said.items():  # an engine core with it on is enough to say it is on
        on = True if "true" in values else False if values == {"false"} else None
        out[name] = EngineInfo(name, "vllm", on, "vLLM's cache_config_info")
    return out
