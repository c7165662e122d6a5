"""Diagnosis: the seed's five traps checked over the window, each with its evidence, cost and knob.

Every figure comes from collector.queries (the detectors in `diagnosis_*`); a trap the stored data cannot
decide says "not enough data" and what would tell, never "fine".
"""

from __future__ import annotations

import streamlit as st

from collector import queries
from collector.queries import diagnosis_base as rules
from dashboard import charts, tables, ui
from dashboard.data import advice, diagnosis

st.title("Diagnosis")
f = ui.current_filters()
ui.page_caption(
    f"Five traps that waste a serving fleet, checked against the data stored for {ui.window_text()}. Each check "
    "names its rule, shows the series and requests behind its verdict, estimates what it costs and points at "
    "the config knob that addresses it, with the command of a tuning study over exactly that knob."
)


def _chart(finding: queries.Finding) -> None:
    df = diagnosis.series(finding)
    if df.empty:
        return
    e = finding.evidence
    threshold: tuple[float, str] | None = None
    percent, y_title = False, "value"
    if finding.trap == "bursts":
        threshold, y_title = (rules.BURST_RATIO * e["baseline_arrivals_per_s"], "burst"), "arrivals/s"
    elif finding.trap == "swap_thrashing":
        threshold, y_title = (rules.SWAP_RATE, "thrashing"), "swaps/s"
    elif finding.trap == "memory_wall":
        threshold, y_title, percent = (rules.KV_FULL, "full"), "of KV memory", True
    elif finding.trap == "cold_start":
        ratio = rules.COLD_RATIO
        threshold, y_title = (ratio * e["rest_p50_s"], f"{ratio:g}x the rest's median"), "seconds"
    elif finding.trap == "mixed_lengths":
        clear = e["short_wait_clear_p50_s"]
        level = max(rules.HOL_RATIO * clear, clear + rules.HOL_MIN_S)
        threshold, y_title = (level, "behind a long prefill"), "seconds"
    title = " and ".join(sorted(set(df["series"])))
    st.altair_chart(
        charts.lines(
            df,
            y="value",
            color="series",
            title=title,
            y_title=y_title,
            percent=percent,
            thresholds=[charts.Level(*threshold)],
        ),
        width="stretch",
    )


def _knob(finding: queries.Finding) -> None:
    knob = queries.KNOBS[finding.knob]
    st.markdown(advice.knob_text(knob, finding.engine))
    st.caption(advice.study_caption(knob, finding.engine, finding.study_command is not None))
    if finding.study_command:
        st.code(finding.study_command, language="bash", wrap_lines=True)


def _present(finding: queries.Finding) -> None:
    with st.container(border=True):
        shout = st.error if finding.severity == "critical" else st.warning
        shout(f"**{finding.instance}**: {finding.summary}", icon=":material/report:")
        st.metric("Estimated cost", diagnosis.cost_text(finding), help=finding.cost)
        st.caption(f"Cost: {finding.cost}")
        _chart(finding)
        if finding.requests:
            with st.expander(f"The requests that show it ({len(finding.requests)}, worst first)"):
                shown = diagnosis.requests(finding)
                tables.show(shown, diagnosis.request_columns(shown), keep_empty=True)
        with st.expander("Figures"):
            st.json(finding.evidence, expanded=True)
        _knob(finding)


with ui.guarded("Diagnosis"):
    found = diagnosis.findings(f)
    if not found:
        ui.empty(
            "engine data",
            "The checks read request, step, sample and allocation events and scraped series; widen the time range "
            "or clear the filters.",
        )
        st.stop()
    present = [x for x in found if x.present]
    unknown = [x for x in found if x.status == "no_data"]
    cols = st.columns(3)
    cols[0].metric("Traps present", len(present), help="(trap, instance) pairs whose rule held in the window")
    cols[1].metric("Not seen", sum(x.status == "absent" for x in found))
    cols[2].metric("Not enough data", len(unknown), help="checks the stored data cannot decide")
    tables.show(diagnosis.table(found), diagnosis.FINDINGS_TABLE, keep_empty=True)

    for key, trap in queries.TRAPS.items():
        st.subheader(trap.title)
        st.caption(f"Seed: {trap.seed}. Rule: {trap.rule}.")
        mine = [x for x in found if x.trap == key]
        for finding in (x for x in mine if x.present):
            _present(finding)
        for finding in (x for x in mine if x.status == "absent"):
            st.success(f"**{finding.instance}**: {finding.summary}", icon=":material/check_circle:")
        for finding in (x for x in mine if x.status == "no_data"):
            st.info(f"**{finding.instance}**: {finding.summary}", icon=":material/help:")

    st.caption(
        "Studies started with these commands appear on the Tuning page under their `diagnosis-...` study name. "
        "`--hours` reaches back from now to the window's start, so the replayed traffic includes anything stored "
        "after the window. kvpilot's engine: drop `--knob` to search the whole space; add `--profile` for the "
        "instance's hardware. vLLM: the study searches vLLM's own arguments (tuner/vllm/space.yml)."
    )
