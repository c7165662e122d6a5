"""Tuning: Optuna studies (trials, history, Pareto front, importances) and proposals to accept or reject."""

from __future__ import annotations

import pandas as pd
import streamlit as st
import yaml

from dashboard import auth, charts, transform, ui
from dashboard.data import tuning
from dashboard.tables import Col, show

st.title("Tuning")
f = ui.current_filters()
ui.page_caption("Optuna studies next to this database and the proposals they wrote.")

st.subheader("Studies")
with ui.guarded("Studies"):
    studies = tuning.studies(f.db_url)
    if studies.empty:
        raise tuning.DataUnavailable(tuning.NO_STUDIES)
    show(
        studies,
        {
            "study": Col("Study", width="large"),
            "engine": Col("Engine", help="whose config the study searched: kvpilot's engine or vLLM's arguments"),
            "kind": Col("Kind", help="a study; a vLLM screen (`kvpilot tune vllm screen`, simulated only)"),
            "directions": Col("Directions", width="medium"),
            "trials": Col("Trials", "count"),
            "started": Col("Started", "time"),
        },
    )
    name = st.selectbox("Study", options=list(studies["study"]), key="study_pick")
    s = tuning.study(f.db_url, name)
    trials = s.trials
    complete = trials[trials["state"] == "COMPLETE"]
    cols = st.columns(4)
    cols[0].metric("Trials", len(trials))
    cols[1].metric("Complete", len(complete))
    cols[2].metric("Pruned / failed", int(trials["state"].isin(["PRUNED", "FAIL"]).sum()))
    cols[3].metric(
        "Pareto-optimal" if len(s.objectives) > 1 else "Objectives",
        len(s.pareto_numbers) if len(s.objectives) > 1 else 1,
    )
    st.caption("Objectives: " + " · ".join(f"**{o}** ({d})" for o, d in zip(s.objectives, s.directions, strict=True)))

    show(
        trials,
        {
            "trial": Col("Trial", "count"),
            "state": Col("State"),
            **{o: Col(transform.human(o), "number", sig=5) for o in s.objectives},
            **{
                c: Col(transform.human(c.removeprefix("param: ")), help=f"`{c.removeprefix('param: ')}` (a parameter)")
                for c in trials.columns
                if c.startswith("param: ")
            },
            "duration (s)": Col("Took", "seconds"),
            "repeat of": Col("Repeat of", "count", help="told that trial's stored result"),
        },
    )

    if complete.empty:
        st.info(
            "No completed trials yet: history, Pareto front and importances appear after the first one.",
            icon=":material/info:",
        )
    else:
        history_cols = st.columns(min(2, len(s.objectives)))
        for i, (objective, direction) in enumerate(zip(s.objectives, s.directions, strict=True)):
            h = complete[["trial", objective]].dropna().sort_values("trial")
            h["best"] = h[objective].cummin() if direction == "minimize" else h[objective].cummax()
            history_cols[i % len(history_cols)].altair_chart(
                charts.history_line(
                    h, y=objective, title=f"Optimization history: {objective} ({direction})", direction=direction
                ),
                width="stretch",
            )
        if len(s.objectives) >= 2:
            c1, c2 = st.columns(2)
            x = c1.selectbox("Pareto x", options=s.objectives, index=0, key="pareto_x")
            y = c2.selectbox("Pareto y", options=s.objectives, index=1, key="pareto_y")
            front = complete.copy()
            front["front"] = front["trial"].map(lambda n: "Pareto front" if n in s.pareto_numbers else "dominated")
            st.altair_chart(
                charts.pareto(front, x=x, y=y, title=f"Pareto front ({len(s.pareto_numbers)} trials)"), width="stretch"
            )
        else:
            best = complete.sort_values(s.objectives[0], ascending=s.directions[0] == "minimize").iloc[0]
            params = {p: best[f"param: {p}"] for p in s.params}
            st.success(
                f"Best trial #{int(best['trial'])}: {s.objectives[0]} = {best[s.objectives[0]]:.5g} with "
                + ", ".join(f"`{k}={v}`" for k, v in params.items()),
                icon=":material/emoji_events:",
            )
        with ui.guarded("Parameter importances"):
            target = (
                st.selectbox("Importances for", options=s.objectives, key="importance_target")
                if len(s.objectives) > 1
                else s.objectives[0]
            )
            imp = tuning.importances(f.db_url, name, s.objectives.index(target))
            if imp.empty:
                st.info("No parameter varies across completed trials.", icon=":material/info:")
            else:
                st.altair_chart(
                    charts.importance_bars(imp, title=f"Parameter importances for {target}"), width="stretch"
                )

st.subheader("Proposals")
with ui.guarded("Proposals"):
    props = tuning.proposals(f.db_url)
    if props.empty:
        raise tuning.DataUnavailable(
            "No tuning proposals yet: a finished `kvpilot tune` run writes one when it beats the running config."
        )
    counts = props["status"].value_counts()
    st.caption(" · ".join(f"{k}: {v}" for k, v in counts.items()))
    show(
        props,
        {
            "id": Col("Proposal", "count"),
            "engine": Col("Engine", help="kvpilot: an engine config file; vllm: a vLLM `--config` file"),
            "status": Col("Status"),
            "study_name": Col("Study", width="large"),
            "instance": Col("Instance", width="medium"),
            "created_at": Col("Created", "time"),
            "updated_at": Col("Updated", "time"),
        },
    )
    pid = st.selectbox(
        "Proposal",
        options=list(props["id"]),
        key="proposal_pick",
        format_func=lambda i: f"#{i} ({props.set_index('id').loc[i, 'status']})",
    )
    p = props.set_index("id").loc[pid]
    vllm = p["engine"] == "vllm"
    st.markdown(f"#### Proposal #{pid} — {p['status']}" + (" (vLLM)" if vllm else ""))
    proposed = yaml.safe_load(p["config_yaml"] or "") or {}

    st.markdown("**Measured before / after**")
    verdict = transform.confirmation_verdict(p["best_metrics"])
    if verdict:
        (st.success if "holds:" in verdict else st.warning)(verdict)
    running = transform.running_capacity_line(p["baseline_metrics"])
    if running:
        st.caption(running)
    sections = transform.proposal_measurements(p["baseline_metrics"], p["best_metrics"])
    if not sections:
        st.caption("The proposal carries no measurements.")
    for title, rows in sections:
        st.caption(title)
        st.dataframe(
            pd.DataFrame(rows),
            hide_index=True,
            width="stretch",
            placeholder="",
            column_config={
                "metric": st.column_config.TextColumn("Metric", width="medium"),
                "before": st.column_config.NumberColumn("Before", format="%.5g"),
                "after": st.column_config.NumberColumn("After", format="%.5g"),
                "change %": st.column_config.NumberColumn("Change", format="%+.1f%%"),
                "change": st.column_config.NumberColumn("Difference", format="%+.5g"),
            },
        )

    st.markdown("**Config diff against the running config**")
    running, source = None, ""
    if vllm:  # the vLLM the study measured: its arguments, as the proposal's baseline recorded them
        running = tuning.vllm_baseline(p["baseline_metrics"])
        source = "vLLM config the study measured"
    with ui.guarded("Running config"):
        configured = {} if vllm else tuning.engines()
        if configured:
            engine_name = st.selectbox(
                "Engine (GET /admin/config)",
                options=list(configured),
                key="engine_pick",
                format_func=lambda n: f"{n} · {configured[n]}",
                help="The engines in KVPILOT_DASHBOARD_ENGINES (name=url,...); the admin token from "
                "KVPILOT_ADMIN_TOKEN is sent to these only.",
            )
            running = tuning.running_config(engine_name)
            source = f"running engine {engine_name}"
    if running is None:
        applied = props[(props["status"] == "applied") & (props["id"] != pid) & (props["engine"] == p["engine"])]
        if not applied.empty:
            last = applied.iloc[0]
            running = yaml.safe_load(last["config_yaml"] or "") or {}
            source = f"last applied proposal #{last['id']}"
    if running is None and vllm:
        st.info("This vLLM proposal did not record the config its study measured.", icon=":material/info:")
    elif running is None:
        st.info(
            "To diff this proposal against the config an engine runs now, name the engine in "
            "`KVPILOT_DASHBOARD_ENGINES=name=http://host:port` (and its admin token in `KVPILOT_ADMIN_TOKEN`).",
            icon=":material/info:",
        )
    else:
        changes = pd.DataFrame(transform.config_changes(running, proposed))
        st.caption(f"Compared with the {source}.")
        if changes.empty:
            st.success("The proposal sets nothing the running config does not already have.")
        else:
            show(
                changes,
                {
                    "setting": Col("Setting", width="large"),
                    "running": Col("Running", width="medium"),
                    "proposed": Col("Proposed", width="medium"),
                },
            )
            st.code(transform.unified_diff(running, proposed, running_label=source), language="diff")
    apply = (
        "vLLM's `--config` file: `kvpilot vllm serve -- --config proposal.yaml` (or `vllm serve --config`)"
        if vllm
        else "apply with `kvpilot engine serve --config proposal.yaml`"
    )
    with st.expander(f"Proposal config ({apply})"):
        st.code(p["config_yaml"], language="yaml")
    if p["report_md"]:
        with st.expander("Report", expanded=False):
            st.markdown(p["report_md"])

    choices = {"pending": ("accepted", "rejected"), "accepted": ("rejected",)}.get(p["status"], ())
    user = auth.writer()
    if choices:
        cols = st.columns([1, 1, 4])
        decision = None
        if "accepted" in choices and cols[0].button(
            "Accept", key=f"accept_{pid}", type="primary", icon=":material/check:", disabled=user is None
        ):
            decision = "accepted"
        if "rejected" in choices and cols[1].button(
            "Reject", key=f"reject_{pid}", icon=":material/close:", disabled=user is None
        ):
            decision = "rejected"
        if user is None:
            auth.need_writer("accept or reject proposals")
        st.caption(
            "Accepting records the decision; restart vLLM with the config above (vLLM reads its arguments at start)."
            if vllm
            else f"Accepting records the decision; `kvpilot tune apply {pid} --engine-url URL` applies it to a "
            "running engine, or restart one with the config above."
        )
        if decision and user is not None:
            try:
                tuning.set_proposal_status(f.db_url, int(pid), decision, user=user)
            except ValueError as exc:
                st.warning(f"Proposal #{pid} not changed: {exc}")
            else:
                st.toast(f"Proposal #{pid} {decision} by {user}.")
                st.rerun()
    else:
        st.caption(f"This proposal is {p['status']}: that is final.")
