"""Every read the dashboard makes, through collector.queries (and alerts/optuna for their tables), cached.

Pages call these through the module (`from dashboard import data; data.latency_summary(f)`), so tests can
monkeypatch one function (STYLE.md 14). Results are DataFrames with display-ready column names; each
cached call is keyed by its arguments, and the TTL bounds how stale an auto-refreshed page can be.
The only writes are proposal status and silences (DESIGN.md).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import Engine, inspect, select
from sqlalchemy.engine import make_url

from collector import queries
from collector.db import check_schema_current, make_engine, session_factory, session_scope
from collector.errors import CollectorError
from collector.schema import AlertState, Proposal
from collector.settings import CollectorSettings

TTL_S = 10
LATENCY_METRICS = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "e2e": "End to end",
    "queue": "Queue",
    "prefill": "Prefill",
    "decode": "Decode",
    "swap": "Swap",
}
QUANTILES = (0.5, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class Filters:
    """What the sidebar selected; every page query takes one."""

    db_url: str
    instances: tuple[str, ...] | None  # None: every instance
    run_id: str | None  # None: every run
    start: float
    end: float
    bucket_s: float

    @property
    def bar_bucket_s(self) -> float:
        """Coarser buckets for bar charts: about 60 bars stay readable where 240 line points do."""
        from dashboard.timewin import pick_bucket_s

        return max(self.bucket_s, pick_bucket_s(self.end - self.start, target_points=60))

    @property
    def instance_list(self) -> list[str] | None:
        return None if self.instances is None else list(self.instances)


class DataUnavailable(Exception):
    """A data source the page needs is missing; the message says what to do."""


def db_url() -> str:
    return CollectorSettings().db_url


@st.cache_resource(show_spinner=False)
def engine(url: str) -> Engine:
    return make_engine(url, pool_size=4)


def _ts(series: pd.Series) -> pd.Series:
    return pd.to_datetime(series, unit="s", utc=True)


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


# --- filters ---------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def runs(url: str) -> pd.DataFrame:
    rows = queries.list_runs(engine(url))
    return pd.DataFrame([r.__dict__ for r in rows], columns=["instance", "run_id", "first_seen_ts", "last_seen_ts"])


@st.cache_data(ttl=TTL_S, show_spinner=False)
def instances(url: str) -> list[str]:
    return [i.name for i in queries.list_instances(engine(url))]


# --- overview --------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def totals(f: Filters) -> dict[str, Any]:
    """Headline numbers of the whole selection: request counts, rates, TTFT/TPOT/e2e quantiles."""
    db = engine(f.db_url)
    rates = queries.request_rates(
        db, start=f.start, end=f.end, group_by="all", instances=f.instance_list, run_id=f.run_id
    )
    out: dict[str, Any] = {
        "requests": 0,
        "finished": 0,
        "failed": 0,
        "rejected": 0,
        "aborted": 0,
        "requests_per_s": 0.0,
        "output_tokens_per_s": 0.0,
        "prompt_tokens_per_s": 0.0,
    }
    if rates:
        out.update({k: getattr(rates[0], k) for k in out})
    for metric in ("ttft", "tpot", "e2e"):
        stats = queries.latency_percentiles(
            db,
            start=f.start,
            end=f.end,
            metric=metric,
            quantiles=QUANTILES,
            group_by="all",
            instances=f.instance_list,
            run_id=f.run_id,
        )
        for q in QUANTILES:
            out[f"{metric}_p{round(q * 100)}"] = stats[0].quantiles[q] if stats else None
    return out


@st.cache_data(ttl=TTL_S, show_spinner=False)
def instance_summary(f: Filters) -> pd.DataFrame:
    """One row per instance: traffic, latency and its newest gauges in the window."""
    db = engine(f.db_url)
    kw = {"start": f.start, "end": f.end, "instances": f.instance_list, "run_id": f.run_id}
    rates = {r.group: r for r in queries.request_rates(db, group_by="instance", **kw)}
    ttft = {
        s.group: s
        for s in queries.latency_percentiles(db, metric="ttft", quantiles=(0.5, 0.99), group_by="instance", **kw)
    }
    e2e = {
        s.group: s for s in queries.latency_percentiles(db, metric="e2e", quantiles=(0.99,), group_by="instance", **kw)
    }
    latest = queries.latest_samples(db, **kw)
    names = sorted(set(rates) | set(latest) | set(ttft))
    rows = []
    for name in names:
        r, s, t, e = rates.get(name), latest.get(name, {}), ttft.get(name), e2e.get(name)
        rows.append(
            {
                "instance": name,
                "requests": r.requests if r else 0,
                "failed": (r.failed + r.rejected + r.aborted) if r else 0,
                "req/s": r.requests_per_s if r else 0.0,
                "output tok/s": r.output_tokens_per_s if r else 0.0,
                "TTFT p50 (s)": t.quantiles[0.5] if t else None,
                "TTFT p99 (s)": t.quantiles[0.99] if t else None,
                "e2e p99 (s)": e.quantiles[0.99] if e else None,
                "KV usage": s.get("kv_usage"),
                "utilization": s.get("utilization"),
                "queue depth": s.get("queue_depth"),
                "running": s.get("running"),
                "last sample": s.get("ts"),
            }
        )
    df = pd.DataFrame(rows)
    if not df.empty:
        df["last sample"] = _ts(df["last sample"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def throughput(f: Filters) -> pd.DataFrame:
    """Engine tokens/s per bucket and instance, from step events (downsampled in SQL)."""
    data = queries.throughput_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    rows = [
        {
            "instance": inst,
            "ts": b.ts,
            "prefill tok/s": b.prefill_tokens_per_s,
            "decode tok/s": b.decode_tokens_per_s,
            "busy": b.busy_fraction,
            "step (s)": b.mean_step_s,
        }
        for inst, buckets in data.items()
        for b in buckets
    ]
    df = pd.DataFrame(rows, columns=["instance", "ts", "prefill tok/s", "decode tok/s", "busy", "step (s)"])
    df["time"] = _ts(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def gauges(f: Filters, names: tuple[str, ...]) -> pd.DataFrame:
    """Canonical gauge series, bucket averages per instance (long format: instance, time, series, value).

    With a run selected, engine-sampled gauges come from that run's samples only; scraped series carry no run
    and are shown whole.
    """
    from collector.series import SAMPLE_COLUMNS

    db = engine(f.db_url)
    rows = []
    per_run = [n for n in names if n in SAMPLE_COLUMNS] if f.run_id is not None else []
    if per_run:
        by_name = queries.run_gauges_over_time(
            db, names=per_run, start=f.start, end=f.end, bucket_s=f.bucket_s, run_id=f.run_id, instances=f.instance_list
        )
        for name, per_instance in by_name.items():
            for inst, points in per_instance.items():
                rows.extend({"instance": inst, "ts": ts, "series": name, "value": v} for ts, v in points)
    for name in names:
        if name in per_run:
            continue
        for inst, points in queries.bucketed(
            db, name=name, start=f.start, end=f.end, bucket_s=f.bucket_s, instances=f.instance_list
        ).items():
            rows.extend({"instance": inst, "ts": ts, "series": name, "value": v} for ts, v in points)
    df = pd.DataFrame(rows, columns=["instance", "ts", "series", "value"])
    df["time"] = _ts(df["ts"])
    return df


# --- latency ---------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def latency_summary(f: Filters) -> pd.DataFrame:
    db = engine(f.db_url)
    rows = []
    for metric, label in LATENCY_METRICS.items():
        stats = queries.latency_percentiles(
            db,
            start=f.start,
            end=f.end,
            metric=metric,
            quantiles=QUANTILES,
            group_by="all",
            instances=f.instance_list,
            run_id=f.run_id,
        )
        if stats:
            s = stats[0]
            rows.append(
                {
                    "stage": label,
                    "requests": s.count,
                    "mean (s)": s.mean,
                    **{f"p{round(q * 100)} (s)": s.quantiles[q] for q in QUANTILES},
                    "max (s)": s.max,
                }
            )
    return pd.DataFrame(rows)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def latency_over_time(f: Filters, metric: str) -> pd.DataFrame:
    buckets = queries.latency_quantiles_over_time(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        bucket_s=f.bucket_s,
        metric=metric,
        quantiles=(0.5, 0.9, 0.99),
        instances=f.instance_list,
        run_id=f.run_id,
    )
    rows = [
        {"ts": b.ts, "quantile": f"p{round(q * 100)}", "seconds": v, "requests": b.count}
        for b in buckets
        for q, v in b.quantiles.items()
        if v is not None
    ]
    df = pd.DataFrame(rows, columns=["ts", "quantile", "seconds", "requests"])
    df["time"] = _ts(df["ts"])
    return df


# The stacked stages, in stack order; they add up to the mean e2e. Decode excludes the swap stage.
STAGES = {
    "queue_s": "queue",
    "prefill_s": "prefill",
    "first_token_gap_s": "first-token gap",
    "decode_excl_swap_s": "decode",
    "swap_s": "swap",
}


@st.cache_data(ttl=TTL_S, show_spinner=False)
def stage_breakdown(f: Filters) -> pd.DataFrame:
    """Mean seconds per stage per bucket (long format for stacked bars, swap its own stage), with swap counts."""
    buckets = queries.stage_breakdown_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bar_bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    rows = [
        {
            "ts": b.ts,
            "stage": label,
            "seconds": getattr(b, key),
            "requests": b.requests,
            "swaps": b.swaps,
            "preemptions": b.preemptions,
            "e2e (s)": b.e2e_s,
        }
        for b in buckets
        for key, label in STAGES.items()
    ]
    df = pd.DataFrame(rows, columns=["ts", "stage", "seconds", "requests", "swaps", "preemptions", "e2e (s)"])
    df["time"] = _ts(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def histogram(f: Filters, metric: str, upper: float | None) -> pd.DataFrame:
    bins = queries.latency_histogram(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        metric=metric,
        bins=40,
        upper=upper,
        instances=f.instance_list,
        run_id=f.run_id,
    )
    return pd.DataFrame([b.__dict__ for b in bins], columns=["lo", "hi", "count"])


@st.cache_data(ttl=TTL_S, show_spinner=False)
def slowest(f: Filters, metric: str, limit: int = 25) -> pd.DataFrame:
    rows = queries.slowest_requests(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        metric=metric,
        limit=limit,
        instances=f.instance_list,
        run_id=f.run_id,
    )
    cols = [
        "request_id",
        "instance",
        "run_id",
        "ts",
        "status",
        "metric_value",
        "queue_s",
        "prefill_s",
        "ttft_s",
        "decode_s",
        "swap_s",
        "e2e_s",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
        "preemptions",
        "swaps",
        "finish_reason",
    ]
    df = pd.DataFrame(rows, columns=cols)
    df["finished at"] = _ts(df["ts"])
    return df.rename(columns={"metric_value": LATENCY_METRICS[metric] + " (s)"}).drop(columns=["ts"])


# --- KV memory -------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def kv_memory(f: Filters) -> pd.DataFrame:
    data = queries.kv_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    names = {
        "kv_usage": "hot tier usage",
        "cold_usage": "cold tier usage",
        "internal_waste": "internal waste",
        "fragmentation": "external fragmentation",
    }
    rows = [
        {"instance": inst, "ts": b.ts, "series": label, "value": getattr(b, key)}
        for inst, buckets in data.items()
        for b in buckets
        for key, label in names.items()
        if getattr(b, key) is not None
    ]
    df = pd.DataFrame(rows, columns=["instance", "ts", "series", "value"])
    df["time"] = _ts(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alloc_ops(f: Filters) -> pd.DataFrame:
    buckets = queries.alloc_ops_over_time(
        engine(f.db_url), start=f.start, end=f.end, bucket_s=f.bar_bucket_s, instances=f.instance_list, run_id=f.run_id
    )
    df = pd.DataFrame([b.__dict__ for b in buckets], columns=["ts", "op", "tier", "events", "blocks", "bytes"])
    df["time"] = _ts(df["ts"])
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alloc_trace(f: Filters, limit: int = 2000) -> tuple[int, pd.DataFrame]:
    """(events in the window, the newest `limit` of them) for the event-level timeline."""
    trace = queries.alloc_trace(
        engine(f.db_url), start=f.start, end=f.end, limit=limit, instances=f.instance_list, run_id=f.run_id
    )
    cols = ["ts", "instance", "run_id", "op", "tier", "request_id", "blocks", "block_size", "bytes", "usage_after"]
    df = pd.DataFrame(trace.events, columns=cols)
    df["time"] = _ts(df["ts"])
    return trace.total, df


# --- alerts ----------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def alert_states(url: str) -> pd.DataFrame:
    """Current alert rows: pending, firing, and resolved within the evaluator's retention."""
    with session_scope(session_factory(engine(url))) as session:
        rows = session.execute(select(AlertState).order_by(AlertState.active_at)).scalars().all()
        data = [
            {
                "alertname": r.rule,
                "state": "resolved" if r.state == "inactive" else r.state,
                "severity": r.labels.get("severity", ""),
                "instance": r.labels.get("instance", ""),
                "summary": r.annotations.get("summary", ""),
                "value": r.last_value,
                "active_at": r.active_at,
                "fired_at": r.fired_at,
                "resolved_at": r.resolved_at,
                "last_eval_at": r.last_eval_at,
                "labels": dict(r.labels),
                "fingerprint": r.fingerprint,
            }
            for r in rows
        ]
    return pd.DataFrame(
        data,
        columns=[
            "alertname",
            "state",
            "severity",
            "instance",
            "summary",
            "value",
            "active_at",
            "fired_at",
            "resolved_at",
            "last_eval_at",
            "labels",
            "fingerprint",
        ],
    )


@st.cache_data(ttl=TTL_S, show_spinner=False)
def deliveries(url: str, limit: int = 200) -> list[dict[str, Any]]:
    from alerts.delivery import list_notifications
    from collector.schema import AlertNotification

    with session_scope(session_factory(engine(url))) as session:
        rows = list_notifications(session, limit=limit)
        bodies = (
            dict(
                session.execute(
                    select(AlertNotification.id, AlertNotification.body).where(
                        AlertNotification.id.in_([r["id"] for r in rows])
                    )
                ).all()
            )
            if rows
            else {}
        )
    for row in rows:
        row["body"] = bodies.get(row["id"], "")
    return rows


def alert_history(url: str, start: float, end: float) -> pd.DataFrame:
    """What was notified in the window, one row per alert per notification (newest first)."""
    from dashboard.transform import alerts_in_notification

    rows = [
        a
        for n in deliveries(url, limit=1000)
        if start <= n["created_at"] < end
        for a in alerts_in_notification(n, n["body"])
    ]
    return pd.DataFrame(
        rows,
        columns=[
            "notified_at",
            "alertname",
            "status",
            "severity",
            "instance",
            "summary",
            "starts_at",
            "ends_at",
            "receiver",
            "delivery",
            "notification_id",
        ],
    )


@st.cache_data(ttl=TTL_S, show_spinner=False)
def silences(url: str) -> list[dict[str, Any]]:
    from alerts.silences import list_silences

    with session_scope(session_factory(engine(url))) as session:
        return list_silences(session, now=time.time(), include_expired=True)


def create_silence(
    url: str, *, matchers: list[str], duration_s: float, created_by: str, comment: str, starts_at: float | None = None
) -> str:
    """Parse amtool-style matchers and store a silence through alerts.silences; ValueError names a bad input."""
    from alerts.silences import SilenceIn, parse_matcher
    from alerts.silences import create_silence as store_silence

    now = time.time()
    start = now if starts_at is None else starts_at
    parsed = [parse_matcher(m) for m in matchers if m.strip()]
    if not parsed:
        raise ValueError("a silence needs at least one matcher, e.g. alertname=KvCacheNearlyFull")
    silence = SilenceIn(
        matchers=parsed, startsAt=start, endsAt=start + duration_s, createdBy=created_by, comment=comment
    )
    with session_scope(session_factory(engine(url))) as session:
        silence_id = store_silence(session, silence, now=now)
    silences.clear()
    return silence_id


def expire_silence(url: str, silence_id: str) -> bool:
    from alerts.silences import expire_silence as expire

    with session_scope(session_factory(engine(url))) as session:
        found = expire(session, silence_id, now=time.time())
    silences.clear()
    return found


# --- targets ---------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def targets(url: str) -> pd.DataFrame:
    rows = [t.__dict__ for t in queries.target_health(engine(url))]
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
        ],
    )


# --- tuning ----------------------------------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def proposals(url: str) -> pd.DataFrame:
    with session_scope(session_factory(engine(url))) as session:
        rows = session.execute(select(Proposal).order_by(Proposal.created_at.desc(), Proposal.id.desc())).scalars()
        data = [
            {
                c: getattr(r, c)
                for c in (
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
                )
            }
            for r in rows
        ]
    return pd.DataFrame(
        data,
        columns=[
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
        ],
    )


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
