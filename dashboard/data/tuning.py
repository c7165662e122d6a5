"""Tuning: proposals through tuner.proposals (list and the compare-and-set review), Optuna studies read-only."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
import yaml
from sqlalchemy import inspect
from sqlalchemy.engine import make_url

from collector.db import make_engine
from collector.errors import CollectorError
from dashboard.data.base import TTL_S, DataUnavailable, engine

PROPOSAL_COLUMNS = [
    "id",
    "engine",  # whose config: `kvpilot` (an EngineConfig) or `vllm` (vLLM's --config file)
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
log = logging.getLogger("kvpilot.dashboard")


@st.cache_data(ttl=TTL_S, show_spinner=False)
def proposals(url: str) -> pd.DataFrame:
    """The newest proposals first (tuner.proposals.list_proposals)."""
    from tuner.proposals import list_proposals

    rows = list_proposals(engine(url), limit=PROPOSALS_SHOWN)
    return pd.DataFrame([{c: getattr(p, c) for c in PROPOSAL_COLUMNS} for p in rows], columns=PROPOSAL_COLUMNS)


def vllm_baseline(baseline_metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """The vLLM config a vLLM study measured as its baseline, in the proposal's own form (vLLM's `--config`
    keys), so the two diff key by key; None where the proposal did not record it."""
    from integrations.vllm.config import VllmConfig, VllmConfigError

    recorded = (baseline_metrics or {}).get("config")
    if not isinstance(recorded, dict):
        return None
    try:
        return yaml.safe_load(VllmConfig.from_dict(recorded, source="baseline").to_config_yaml()) or {}
    except (VllmConfigError, ValueError, TypeError) as exc:
        log.warning("a vLLM proposal's baseline config is not readable: %s", exc)
        return None


def set_proposal_status(url: str, proposal_id: int, status: str, *, user: str) -> None:
    """Accept or reject a proposal through the tuner's compare-and-set transition (tuner.proposals).

    `user` is the signed-in user (dashboard.auth) the decision is logged under; pages call this only
    with one.

    Raises tuner.proposals.ProposalError (a ValueError) when the transition is not allowed or someone else
    decided first; the page shows its message.
    """
    from tuner.proposals import set_status

    if not user:
        raise PermissionError("deciding on a proposal needs a signed-in user")
    if status not in ("accepted", "rejected"):
        raise ValueError(f"the dashboard only accepts or rejects proposals, not {status!r}")
    try:
        set_status(engine(url), proposal_id, status)
    finally:
        proposals.clear()
    log.info("proposal %d %s by %s (dashboard)", proposal_id, status, user)


MAX_CONFIG_BYTES = 1 << 20
ADMIN_ANSWERS = {
    401: "the engine refused the admin token: set KVPILOT_ADMIN_TOKEN to its `server.admin_token`",
    403: "the engine refused the admin token: set KVPILOT_ADMIN_TOKEN to its `server.admin_token`",
    404: "it has no /admin/config: is it a kvpilot engine?",
}


def engines() -> dict[str, str]:
    """name -> base URL of the engines the operator configured (dashboard.settings); never a visitor's URL."""
    from dashboard import settings

    try:
        return settings.load().engine_map()
    except ValueError as exc:  # SettingsError, or pydantic's ValidationError for another variable
        raise DataUnavailable(f"the engine settings are not usable: {exc}") from exc


def running_config(name: str) -> dict[str, Any]:
    """The live config of the configured engine `name` from GET /admin/config (a read).

    The admin token goes only to a URL from the settings, redirects are not followed, and what the
    engine answers is never shown: a failure says the status and what to check (docs/architecture.md: no echo).
    """
    import httpx

    from dashboard import settings

    url = engines().get(name)
    if url is None:
        raise DataUnavailable(f"no engine named {name!r} is configured (KVPILOT_DASHBOARD_ENGINES)")
    token = settings.load().admin_token
    headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
    try:
        with httpx.stream("GET", f"{url}/admin/config", headers=headers, timeout=3.0) as response:
            if response.status_code != 200:
                why = ADMIN_ANSWERS.get(response.status_code, "see the engine's log for why")
                raise DataUnavailable(f"engine {name!r} answered HTTP {response.status_code}: {why}.")
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_CONFIG_BYTES:
                    raise DataUnavailable(f"engine {name!r} answered with more than 1 MiB: not a config.")
    except httpx.HTTPError as exc:
        raise DataUnavailable(f"engine {name!r} at {url} is unreachable ({type(exc).__name__}).") from exc
    try:
        config = json.loads(body).get("config")
    except (ValueError, AttributeError) as exc:
        raise DataUnavailable(f"engine {name!r} did not answer with a kvpilot config.") from exc
    if not isinstance(config, dict):
        raise DataUnavailable(f"engine {name!r} did not answer with a kvpilot config.")
    return config


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
    # Never create the storage or Optuna's tables from the dashboard: it only reads (docs/architecture.md).
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
            "engine": study_engine(s.user_attrs),
            "kind": s.user_attrs.get("kind", "study"),
            "directions": ", ".join(d.name.lower() for d in s.directions),
            "trials": s.n_trials,
            "started": s.datetime_start,
        }
        for s in summaries
    ]
    return pd.DataFrame(rows, columns=["study", "engine", "kind", "directions", "trials", "started"])


def study_engine(attrs: dict[str, Any]) -> str:
    """Whose config a study searched: its `engine` tag (tuner.study.tag_study: vLLM's screens and studies), else
    the backend it ran on (`vllm-...` for vLLM), else kvpilot's engine."""
    if "engine" in attrs:
        return str(attrs["engine"])
    return "vllm" if str(attrs.get("backend", "")).startswith("vllm") else "kvpilot"


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
