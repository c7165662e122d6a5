"""What there is to look at: instances (pushed and scraped), runs and scrape targets."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine, label_text

# How the tuner names what it stores (tuner/backends.py, tuner/study.py, tuner/nightly.py): its replay
# backends push as instance `tuner-sim` (the simulator) or `tuner-engine` (an in-process engine), and each
# trial's events carry the run id `<study>-t<n>-<6 hex>` (`-s<seed>` per extra seed), confirmation re-runs
# `<study>-confirm-<baseline|best>-s<seed>-<6 hex>` (before the capacity comparison), and every capacity replay
# (`tuner.capacity.replay_capacity`) `<search>-x<multiplier>`, where a comparison's search is
# `<name>-<running|candidate>-s<seed>-p<pair>-<k>` (`s` when it went on as a scout) and a tuning's own
# `<name>-capacity-<label>` or `<name>-simcap`.
TUNER_RUN_ID = re.compile(
    r"-(?:t\d+-[0-9a-f]{6}(?:-s\d+)?|confirm-[A-Za-z0-9_.]+-s\d+-[0-9a-f]{6}"
    r"|(?:s\d+-p\d+-\d+s?|capacity-[A-Za-z0-9_.-]+|simcap)-x\d+(?:\.\d+)?(?:e[+-]\d+)?)$"
)


def is_simulated(instance: str, run_id: str | None = None) -> bool:
    """Whether data is the tuner's replay (a simulated or trial run) rather than traffic an engine served.

    The one rule the sidebar, the run list and every serving view use to keep such data out unless asked.
    """
    if queries.is_simulated_instance(instance):
        return True
    return run_id is not None and TUNER_RUN_ID.search(run_id) is not None


def simulated_instances(infos: Iterable[queries.InstanceInfo], runs: pd.DataFrame) -> set[str]:
    """Instances with only the tuner's data: a tuner instance, or pushed runs that are all trial runs."""
    out = set()
    for info in infos:
        own = runs[runs["instance"] == info.name]["run_id"]
        trials_only = not own.empty and all(is_simulated(info.name, r) for r in own)
        if is_simulated(info.name) or (trials_only and "scrape" not in info.sources):
            out.add(info.name)
    return out


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
