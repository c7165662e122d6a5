"""Tuning: proposals through tuner.proposals (list and the compare-and-set review), Optuna studies read-only."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import inspect
from sqlalchemy.engine import make_url

from collector.db import make_engine
from collector.errors import CollectorError
from dashboard.data.base import TTL_S, DataUnavailable, engine

PROPOSAL_COLUMNS = [
    "id",
    "created_at",
    "updated_at",
    "status",
    "study_name",
    "instance",
    "config_yaml",
    "report_md",
    "baseline_metrics",
    "best_metrics",
]
PROPOSALS_SHOWN = 500


@st.cache_data(ttl=TTL_S, show_spinner=False)
def proposals(url: str) -> pd.DataFrame:
    """The newest proposals first (tuner.proposals.list_proposals)."""
    from tuner.proposals import list_proposals

    rows = list_proposals(engine(url), limit=PROPOSALS_SHOWN)
    return pd.DataFrame([{c: getattr(p, c) for c in PROPOSAL_COLUMNS} for p in rows], columns=PROPOSAL_COLUMNS)


def set_proposal_status(url: str, proposal_id: int, status: str) -> None:
    """Accept or reject a proposal through the tuner's compare-and-set transition (tuner.proposals).

    Raises tuner.proposals.ProposalError (a ValueError) when the transition is not allowed or someone else
    decided first; the page shows its message.
    """
    from tuner.proposals import set_status

    if status not in ("accepted", "rejected"):
        raise ValueError(f"the dashboard only accepts or rejects proposals, not {status!r}")
    try:
        set_status(engine(url), proposal_id, status)
    finally:
        proposals.clear()


def running_config(engine_url: str, token: str | None) -> dict[str, Any]:
    """The engine's live config from GET /admin/config (a read); DataUnavailable says why it failed."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(engine_url.rstrip("/") + "/admin/config", headers=headers, timeout=3.0)
    except httpx.HTTPError as exc:
        raise DataUnavailable(f"engine at {engine_url} unreachable: {exc}") from exc
    if response.status_code != 200:
        raise DataUnavailable(f"GET {engine_url}/admin/config answered {response.status_code}: {response.text[:200]}")
    return dict(response.json().get("config") or {})


def _optuna() -> Any:
    try:
        import optuna
    except ImportError as exc:
        raise DataUnavailable(
            "Optuna is not installed here, so studies cannot be read: "
            "`pip install optuna` (kvpilot's tuner depends on it)."
        ) from exc
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def study_storage_url(url: str) -> str:
    """Where the tuner keeps studies for this database (tuner.storage: a sibling SQLite file or a schema)."""
    from tuner.storage import optuna_storage_url

    return optuna_storage_url(url)


NO_STUDIES = "No Optuna studies for this database yet: `kvpilot tune` runs one (and writes a proposal)."


@st.cache_resource(show_spinner=False)
def _optuna_storage(url: str) -> Any:
    optuna = _optuna()
    storage_url = study_storage_url(url)
    parsed = make_url(storage_url)
    # Never create the storage or Optuna's tables from the dashboard: it only reads (DESIGN.md).
    if parsed.get_backend_name() == "sqlite" and (
        not parsed.database or parsed.database == ":memory:" or not Path(parsed.database).exists()
    ):
        raise DataUnavailable(NO_STUDIES)
    probe = make_engine(storage_url, pool_size=1)
    try:
        has_studies = inspect(probe).has_table("studies")
    except CollectorError as exc:
        raise DataUnavailable(f"{NO_STUDIES} ({exc})") from exc
    except Exception as exc:  # a missing PostgreSQL schema and the like: no storage yet
        raise DataUnavailable(f"{NO_STUDIES} ({type(exc).__name__})") from exc
    finally:
        probe.dispose()
    if not has_studies:
        raise DataUnavailable(NO_STUDIES)
    return optuna.storages.RDBStorage(storage_url, skip_table_creation=True, skip_compatibility_check=True)


def _storage(url: str) -> Any:
    try:
        return _optuna_storage(url)
    except DataUnavailable:
        _optuna_storage.clear()
        raise


@st.cache_data(ttl=TTL_S, show_spinner=False)
def studies(url: str) -> pd.DataFrame:
    optuna = _optuna()
    summaries = optuna.get_all_study_summaries(_storage(url), include_best_trial=False)
    rows = [
        {
            "study": s.study_name,
            "directions": ", ".join(d.name.lower() for d in s.directions),
            "trials": s.n_trials,
            "started": s.datetime_start,
        }
        for s in summaries
    ]
    return pd.DataFrame(rows, columns=["study", "directions", "trials", "started"])


@dataclass(frozen=True)
class StudyData:
    name: str
    objectives: list[str]
    directions: list[str]
    trials: pd.DataFrame  # number, state, one column per objective, params as "param: <name>", duration (s)
    pareto_numbers: list[int]
    params: list[str]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def study(url: str, name: str) -> StudyData:
    optuna = _optuna()
    s = optuna.load_study(study_name=name, storage=_storage(url))
    directions = [d.name.lower() for d in s.directions]
    objectives = list(s.metric_names or []) or (
        ["objective"] if len(directions) == 1 else [f"objective {i}" for i in range(len(directions))]
    )
    params = sorted({p for t in s.trials for p in t.params})
    rows = []
    for t in s.trials:
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name}
        values = t.values or []
        for i, objective in enumerate(objectives):
            row[objective] = values[i] if i < len(values) else None
        for p in params:
            row[f"param: {p}"] = t.params.get(p)
        row["duration (s)"] = t.duration.total_seconds() if t.duration else None
        row["repeat of"] = t.user_attrs.get("duplicate_of")  # told that trial's stored result, not measured
        rows.append(row)
    columns = ["trial", "state", *objectives, *[f"param: {p}" for p in params], "duration (s)", "repeat of"]
    complete = [t for t in s.trials if t.state == optuna.trial.TrialState.COMPLETE]
    pareto = [t.number for t in s.best_trials] if complete else []
    return StudyData(name, objectives, directions, pd.DataFrame(rows, columns=columns), pareto, params)


@st.cache_data(ttl=60, show_spinner=False)
def importances(url: str, name: str, objective_index: int) -> pd.DataFrame:
    """PED-ANOVA parameter importances for one objective: numpy only (fANOVA would need scikit-learn) and
    deterministic, so a page reload shows the same bars."""
    optuna = _optuna()
    s = optuna.load_study(study_name=name, storage=_storage(url))
    evaluator = optuna.importance.PedAnovaImportanceEvaluator()
    # PED-ANOVA explains what achieves *low* target values; flip maximized objectives.
    sign = -1.0 if s.directions[objective_index] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the "low target values" note: handled by `sign`
            result = optuna.importance.get_param_importances(
                s, evaluator=evaluator, target=lambda t: sign * t.values[objective_index]
            )
    except (ValueError, RuntimeError) as exc:
        raise DataUnavailable(f"importances need completed trials that vary their parameters ({exc})") from exc
    return pd.DataFrame(
        [{"parameter": k, "importance": v} for k, v in result.items()], columns=["parameter", "importance"]
    )


def default_engine_url() -> str:
    return os.environ.get("KVPILOT_ENGINE_URL", "")
