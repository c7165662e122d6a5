"""The sidebar: instance, run and time range filters and the auto-refresh option, resolved into `Filters`."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import pandas as pd
import streamlit as st

from collector.db import redact
from collector.queries import InstanceInfo
from dashboard import timewin
from dashboard.data import Filters, catalog

ALL_RUNS = "__all__"
REFRESH_CHOICES_S = (10, 30, 60, 300)


def _run_label(run_id: str, runs: pd.DataFrame) -> str:
    if run_id == ALL_RUNS:
        return "All runs"
    rows = runs[runs["run_id"] == run_id]
    where = ", ".join(sorted(rows["instance"]))
    return f"{run_id} · {where} · to {timewin.fmt_ts(rows['last_seen_ts'].max())[5:16]}"


def _span(
    runs: pd.DataFrame, instances: list[str] | None, run_id: str | None, infos: list[InstanceInfo]
) -> tuple[float, float] | None:
    """First and last event of the selected runs; for scraped instances (no runs), first and last scrape."""
    sel = runs
    if instances:
        sel = sel[sel["instance"].isin(instances)]
    if run_id is not None:
        sel = sel[sel["run_id"] == run_id]
    if not sel.empty:
        return float(sel["first_seen_ts"].min()), float(sel["last_seen_ts"].max())
    scraped = [i for i in infos if (not instances or i.name in instances) and "scrape" in i.sources]
    if run_id is None and scraped:
        return min(i.first_seen_ts for i in scraped), max(i.last_seen_ts for i in scraped)
    return None


def _custom_range(span: tuple[float, float] | None, now: float) -> tuple[float, float]:
    lo = datetime.fromtimestamp(span[0] if span else now - 3600, tz=UTC)
    hi = datetime.fromtimestamp((span[1] + 1) if span else now, tz=UTC)
    c1, c2 = st.sidebar.columns(2)
    start_d = c1.date_input("From (UTC)", value=lo.date(), key="f_start_date")
    start_t = c2.time_input("at", value=lo.time().replace(microsecond=0), key="f_start_time", step=60)
    c3, c4 = st.sidebar.columns(2)
    end_d = c3.date_input("To (UTC)", value=hi.date(), key="f_end_date")
    end_t = c4.time_input(
        "at ", value=(hi + timedelta(minutes=1)).time().replace(second=0, microsecond=0), key="f_end_time", step=60
    )
    start = datetime.combine(start_d, start_t, tzinfo=UTC).timestamp()
    end = datetime.combine(end_d, end_t, tzinfo=UTC).timestamp()
    return start, end


def _seed_from_url(instances: list[str]) -> None:
    """Once per session, take the filters from the URL, so a copied link opens the same view."""
    if st.session_state.get("f_from_url"):
        return
    st.session_state["f_from_url"] = True
    q = st.query_params
    if q.get("sim") == "1":
        st.session_state["f_sim"] = True
    if "instance" in q:
        st.session_state["f_instances"] = [i for i in q.get_all("instance") if i in instances]
    if "run" in q:
        st.session_state["f_run"] = q["run"]  # checked against the runs below
    if q.get("range") in timewin.PRESETS:
        st.session_state["f_range"] = q["range"]
    if q.get("range") == timewin.CUSTOM and "from" in q and "to" in q:
        try:
            lo, hi = (datetime.fromtimestamp(float(q[k]), tz=UTC) for k in ("from", "to"))
        except ValueError:
            return
        st.session_state.update(
            f_start_date=lo.date(),
            f_start_time=lo.time().replace(microsecond=0),
            f_end_date=hi.date(),
            f_end_time=hi.time().replace(microsecond=0),
        )


def _write_url(chosen: list[str], run_id: str | None, window: timewin.Window, include_sim: bool) -> None:
    params: dict[str, str | list[str]] = {
        "range": window.label if window.label in timewin.PRESETS else timewin.WHOLE_RUN
    }
    if include_sim:
        params["sim"] = "1"
    if chosen:
        params["instance"] = chosen
    if run_id is not None:
        params["run"] = run_id
    if window.label == timewin.CUSTOM:
        params["from"], params["to"] = f"{window.start:.0f}", f"{window.end:.0f}"
    st.query_params.from_dict(params)


def sidebar(url: str, *, now: float | None = None) -> tuple[Filters, timewin.Window] | None:
    """Draw the filters; None (with the reason shown) when the range is unusable."""
    # Whole 5 s steps: reruns within a few seconds share cache entries instead of missing on a new `now`.
    now = math.ceil(time.time() / 5.0) * 5.0 if now is None else now
    all_runs = catalog.runs(url)
    all_infos = catalog.instance_infos(url)
    side = st.sidebar
    side.subheader("Filters")
    _seed_from_url([i.name for i in all_infos])
    simulated = catalog.simulated_instances(all_infos, all_runs)
    include_sim = side.toggle(
        "Include simulated and trial runs",
        key="f_sim",
        help="The tuner's replays (instances `tuner-sim`, `tuner-engine`; trial and confirmation runs) are "
        "not traffic anyone served: they stay out of every figure unless this is on.",
    )
    hidden = () if include_sim else tuple(sorted(simulated))
    infos = [i for i in all_infos if i.name not in hidden]
    real = [not catalog.is_simulated(i, r) for i, r in zip(all_runs["instance"], all_runs["run_id"], strict=True)]
    runs = all_runs if include_sim else all_runs[pd.Series(real, index=all_runs.index, dtype=bool)]
    instances = [i.name for i in infos]
    described = {i.name: catalog.describe(i) for i in infos}
    if any(name not in instances for name in st.session_state.get("f_instances", [])):
        st.session_state["f_instances"] = [n for n in st.session_state["f_instances"] if n in instances]
    chosen = side.multiselect(
        "Instances",
        options=instances,
        key="f_instances",
        placeholder="All instances",
        format_func=lambda name: described.get(name, name),
        help="Engines that push events and scraped targets (vLLM, SGLang, DCGM) by their `instance` label, "
        "with where their data comes from and their target labels; none selected means all of them.",
    )
    if hidden:
        side.caption(f"Left out: {', '.join(f'`{n}`' for n in hidden)} (simulated).")
    pool = runs[runs["instance"].isin(chosen)] if chosen else runs
    run_ids = [ALL_RUNS, *dict.fromkeys(pool["run_id"])]
    if st.session_state.get("f_run") not in run_ids:
        st.session_state["f_run"] = ALL_RUNS
    run_choice = side.selectbox("Run", options=run_ids, key="f_run", format_func=lambda r: _run_label(r, runs))
    run_id = None if run_choice == ALL_RUNS else run_choice
    span = _span(runs, chosen or None, run_id, infos)

    if "f_range" not in st.session_state:
        st.session_state["f_range"] = timewin.default_preset(_span(runs, None, None, infos), now)
    preset = side.selectbox(
        "Time range",
        options=timewin.PRESETS,
        key="f_range",
        help="'Whole run' spans the selected run(s) from first to last event.",
    )
    custom = _custom_range(span, now) if preset == timewin.CUSTOM else None
    try:
        window = timewin.resolve(preset, now=now, run_span=span, custom=custom)
    except ValueError as exc:
        side.error(f"{exc}: pick an end after the start.")
        return None
    _write_url(chosen, run_id, window, include_sim)
    bucket_s = timewin.pick_bucket_s(window.span_s)
    side.caption(f"{window.describe()} · charts in {timewin.fmt_span(bucket_s)} buckets")

    side.divider()
    refresh = side.toggle("Auto-refresh", key="f_refresh", help="Re-run the page on an interval (live runs).")
    if refresh:
        side.selectbox("Every", options=REFRESH_CHOICES_S, key="f_refresh_s", format_func=lambda s: f"{s} s")
    if side.button("Refresh now", key="f_refresh_now", icon=":material/refresh:"):
        st.cache_data.clear()
    side.caption(f"Database: `{redact(url)}`")
    shown = tuple(chosen) if chosen else (tuple(instances) if hidden else None)
    filters = Filters(
        db_url=url,
        instances=shown,
        run_id=run_id,
        start=window.start,
        end=window.end,
        bucket_s=bucket_s,
        picked=bool(chosen),
        hidden=hidden,
    )
    return filters, window


def refresh_interval_s() -> float | None:
    if not st.session_state.get("f_refresh"):
        return None
    return float(st.session_state.get("f_refresh_s", REFRESH_CHOICES_S[1]))
