"""Fixtures: a seeded database (seeded once per session, copied per test) and AppTest on dashboard/app.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from collector.db import make_engine
from tests.dashboard.seed import Seed, seed_database

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """AppTest has no server: read its bind address as `kvpilot dashboard` sets it (loopback), and start
    every test without dashboard settings from the environment (read-only, no engines, built-in rules)."""
    from dashboard import auth

    monkeypatch.setattr(auth, "bind_address", lambda: "127.0.0.1")
    for name in (
        "KVPILOT_DASHBOARD_ENGINES",
        "KVPILOT_DASHBOARD_ENGINE_URL",
        "KVPILOT_ENGINE_URL",
        "KVPILOT_DASHBOARD_ADMIN_TOKEN",
        "KVPILOT_ADMIN_TOKEN",
        "KVPILOT_DASHBOARD_PASSWORD",
        "KVPILOT_DASHBOARD_TRUST_PROXY_HEADER",
        "KVPILOT_DASHBOARD_CLIENT_ADDRESS_HEADER",
        "KVPILOT_DASHBOARD_RULE_FILES",
    ):
        monkeypatch.delenv(name, raising=False)
    auth.FAILURES.clear()


PAGE_FILES = {
    "overview": "app_pages/overview.py",
    "latency": "app_pages/latency.py",
    "kv_memory": "app_pages/kv_memory.py",
    "diagnosis": "app_pages/diagnosis.py",
    "alerts": "app_pages/alerts.py",
    "tuning": "app_pages/tuning.py",
    "targets": "app_pages/targets.py",
}


@pytest.fixture(scope="session")
def _seeded_template(_sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Seed]:
    path = tmp_path_factory.mktemp("dashboard-seed") / "seeded.db"
    shutil.copyfile(_sqlite_template, path)
    seed = seed_database(f"sqlite:///{path}")
    engine = make_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path, seed


@pytest.fixture
def seeded(_seeded_template: tuple[Path, Seed], tmp_path: Path) -> Seed:
    """A private copy of the seeded database (tests that accept proposals or create silences write to it)."""
    template, seed = _seeded_template
    path = tmp_path / "kvpilot.db"
    shutil.copyfile(template, path)
    # The tuner keeps studies beside the database (tuner.storage): copy that file too.
    studies = template.with_name(f"{template.stem}-optuna.db")
    if studies.exists():
        shutil.copyfile(studies, path.with_name(f"{path.stem}-optuna.db"))
    return Seed(
        url=f"sqlite:///{path}",
        requests=seed.requests,
        samples=seed.samples,
        steps=seed.steps,
        allocs=seed.allocs,
        study_name=seed.study_name,
    )


@pytest.fixture
def open_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., AppTest]]:
    """open_page(db_url, page) -> an AppTest that ran the dashboard and then the page."""
    st.cache_data.clear()
    st.cache_resource.clear()

    def _open(db_url: str, page: str = "overview") -> AppTest:
        monkeypatch.setenv("KVPILOT_DB_URL", db_url)
        at = AppTest.from_file(str(APP), default_timeout=30).run()
        if page != "overview":
            at.switch_page(PAGE_FILES[page]).run()
        return at

    yield _open
    st.cache_data.clear()
    st.cache_resource.clear()  # disposes nothing, but the next test gets a fresh engine for its own URL


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def texts(at: AppTest) -> str:
    """Every message, markdown and caption on the page, joined (for 'does the page say X' checks)."""
    parts = [e.value for e in (*at.error, *at.info, *at.success, *at.warning)]
    parts += [m.value for m in at.markdown] + [c.value for c in at.caption]
    return "\n".join(str(p) for p in parts)


def table_with(at: AppTest, *columns: str) -> pd.DataFrame:
    """The first table on the page that shows all of `columns` (tables show only their own columns)."""
    for frame in at.dataframe:
        if all(c in frame.value.columns for c in columns):
            return frame.value
    raise AssertionError(f"no table with {columns}; tables: {[list(d.value.columns) for d in at.dataframe]}")


PASSWORD = "correct-horse-battery"


def sign_in(at: AppTest, name: str = "alice", password: str = PASSWORD) -> AppTest:
    """Sign in through the sidebar form, as a visitor does (KVPILOT_DASHBOARD_PASSWORD must be set)."""
    at.text_input(key="auth_name").set_value(name)
    at.text_input(key="auth_password").set_value(password)
    next(b for b in at.button if b.label == "Sign in").click().run()
    return at


@pytest.fixture
def mixed(seeded: Seed) -> Seed:
    """The seed plus the tuner's simulated runs and a KV spike to 100% on e0 (tests/dashboard/seed_sim.py)."""
    from tests.dashboard.seed_sim import add_simulated_and_spike

    add_simulated_and_spike(seeded.url)
    return seeded
