"""What there is to look at: instances (pushed and scraped), runs and scrape targets."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine, label_text


@st.cache_data(ttl=TTL_S, show_spinner=False)
def runs(url: str) -> pd.DataFrame:
    rows = queries.list_runs(engine(url))
    return pd.DataFrame([r.__dict__ for r in rows], columns=["instance", "run_id", "first_seen_ts", "last_seen_ts"])


@st.cache_data(ttl=TTL_S, show_spinner=False)
def instance_infos(url: str) -> list[queries.InstanceInfo]:
    """Every instance, pushed or scraped, with its sources, jobs and static target labels."""
    return queries.list_instances(engine(url))


def instances(url: str) -> list[str]:
    return [i.name for i in instance_infos(url)]


def describe(info: queries.InstanceInfo) -> str:
    """How the sidebar names an instance: `gpu-node-1 · scrape · job=dcgm · node=node-1`."""
    labels = {**({"job": ",".join(info.jobs)} if info.jobs else {}), **info.labels}
    parts = [info.name, "+".join(info.sources) or "no data", label_text(labels)]
    return " · ".join(p for p in parts if p)


@dataclass(frozen=True)
class Selection:
    """The selected instances by where their data comes from."""

    pushed: tuple[str, ...]  # engine events (requests, steps, samples, allocations)
    scraped: tuple[str, ...]  # a scrape target (some also push)

    @property
    def scrape_only(self) -> tuple[str, ...]:
        """Instances with scrapes and no per-request events."""
        return tuple(n for n in self.scraped if n not in self.pushed)


def selection(f: Filters) -> Selection:
    chosen = [i for i in instance_infos(f.db_url) if f.instances is None or i.name in f.instances]
    return Selection(
        pushed=tuple(i.name for i in chosen if "push" in i.sources),
        scraped=tuple(i.name for i in chosen if "scrape" in i.sources),
    )


def instance_labels(url: str) -> dict[str, str]:
    """instance -> `job=... · node=...` for the tables."""
    return {
        i.name: label_text({**({"job": ",".join(i.jobs)} if i.jobs else {}), **i.labels}) for i in instance_infos(url)
    }


@st.cache_data(ttl=TTL_S, show_spinner=False)
def targets(url: str) -> pd.DataFrame:
    rows = [{**t.__dict__, "labels": label_text(t.labels)} for t in queries.target_health(engine(url))]
    return pd.DataFrame(
        rows,
        columns=[
            "id",
            "url",
            "job",
            "instance",
            "up",
            "last_error",
            "last_scrape_at",
            "scrape_duration_s",
            "interval_s",
            "enabled",
            "labels",
            "sample_limit",
        ],
    )
