"""What every dashboard read shares: the sidebar's `Filters`, the cached engine, the schema check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import streamlit as st
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from collector.db import check_schema_current, make_engine
from collector.errors import CollectorError
from collector.settings import CollectorSettings

TTL_S = 10


@dataclass(frozen=True)
class Filters:
    """What the sidebar selected; every page query takes one."""

    db_url: str
    instances: tuple[str, ...] | None  # None: every instance
    run_id: str | None  # None: every run
    start: float
    end: float
    bucket_s: float
    picked: bool = False  # the visitor picked `instances` (else: every instance shown)
    hidden: tuple[str, ...] = ()  # simulated instances left out (catalog.is_simulated), unless asked for

    @property
    def bar_bucket_s(self) -> float:
        """Coarser buckets for bar charts: about 60 bars stay readable where 300 line points do."""
        from dashboard.timewin import pick_bucket_s

        return max(self.bucket_s, pick_bucket_s(self.end - self.start, target_points=60))

    @property
    def instance_list(self) -> list[str] | None:
        return None if self.instances is None else list(self.instances)

    def shows(self, instance: str) -> bool:
        """Whether rows labelled with `instance` belong in the view ('' is fleet-wide: always)."""
        if not instance:
            return True
        return instance not in self.hidden if self.instances is None else instance in self.instances


class DataUnavailable(Exception):
    """A data source the page needs is missing; the message says what to do."""


def db_url() -> str:
    return CollectorSettings().db_url


@st.cache_resource(show_spinner=False)
def engine(url: str) -> Engine:
    return make_engine(url, pool_size=4)


def to_time(series: pd.Series) -> pd.Series:
    return pd.to_datetime(series, unit="s", utc=True)


def label_text(labels: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
    """A label set as a reader scans it: `engine=0 · model_name=m` ('' for none)."""
    pairs = labels.items() if isinstance(labels, dict) else labels
    return " · ".join(f"{k}={v}" for k, v in sorted(pairs))


@st.cache_data(ttl=60, show_spinner=False)
def schema_problem(url: str) -> str | None:
    """Why the dashboard cannot read this database (missing file, not migrated, unreachable), or None."""
    parsed = make_url(url)
    database = parsed.database
    if (
        parsed.get_backend_name() == "sqlite"
        and database
        and database != ":memory:"
        and not database.startswith("file:")
        and not Path(database).expanduser().exists()
    ):
        return (
            f"No database at {database}. Start the collector (`kvpilot collector serve`) or run "
            "`kvpilot demo`, or point KVPILOT_DB_URL (`kvpilot dashboard --db URL`) at an existing one."
        )
    try:
        check_schema_current(engine(url))
    except CollectorError as exc:
        return f"{exc}"
    return None
