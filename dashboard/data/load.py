"""An engine's load — KV usage, requests running and waiting — from every step where steps are stored.

A chart of peaks built from gauges sampled every few seconds shows a calmer engine than the one that ran:
vLLM's iteration log and kvpilot's step events hold every step, so instances that have steps are drawn from
them (`collector.queries.step_load_over_time`), and only the others from their sampled gauges, each line
with its source, and a sampled line is called a sample, never a peak. vLLM's steps carry no queue length,
so a vLLM's waiting line is its sampled `vllm:num_requests_waiting`.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from collector import queries
from collector.queries.engine_peaks import KVPILOT_STEPS, VLLM_STEPS
from collector.queries.step_rollup import ROLLUP_NOTE
from dashboard.data import serving
from dashboard.data.base import TTL_S, Filters, engine, to_time
from dashboard.data.catalog import selection

SAMPLED = "sampled gauges (the highest sample, not a peak)"
FLEET = "fleet"  # the `instance` of the envelope's rows
COLUMNS = ["instance", "line", "ts", "series", "value", "source"]
_FIELD = {"kv_usage": "kv_usage", "running": "running", "queue_depth": "waiting"}


def shown_instances(f: Filters) -> list[str]:
    """The instances the view shows (the sidebar's pick, or every one but the hidden simulated runs)."""
    sel = selection(f)
    return [n for n in dict.fromkeys((*sel.pushed, *sel.scraped)) if f.shows(n)]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def facts(f: Filters) -> queries.StepFacts:
    """The shown instances' step peaks and sampling engines: what the peaks and the load lines both start from."""
    return queries.step_facts(engine(f.db_url), start=f.start, end=f.end, instances=shown_instances(f), run_id=f.run_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def peaks(f: Filters) -> queries.EnginePeaks:
    """The window's KV usage, running and waiting peaks over the shown instances, with their sources."""
    return queries.engine_peaks(
        engine(f.db_url), start=f.start, end=f.end, instances=shown_instances(f), run_id=f.run_id, facts=facts(f)
    )


@st.cache_data(ttl=TTL_S, show_spinner=False)
def lines(f: Filters) -> queries.LoadLines:
    """The shown instances' load lines, every series at once: a page's two load charts read them once."""
    return queries.step_load_lines(
        engine(f.db_url),
        start=f.start,
        end=f.end,
        bucket_s=f.bucket_s,
        instances=shown_instances(f),
        run_id=f.run_id,
        facts=facts(f),
    )


@st.cache_data(ttl=TTL_S, show_spinner=False)
def over_time(f: Filters, names: tuple[str, ...]) -> pd.DataFrame:
    """Per bucket, the fullest step of each instance with steps, else its highest sample (long format).

    `names` among kv_usage, running, queue_depth; `source` names where each line comes from. Past a dozen
    instances with steps, those are drawn as the fleet's highest and mean peak per bucket, and only the few
    instances of the highest peaks of each series by name (`collector.queries.step_load_lines`).
    """
    unknown = [n for n in names if n not in _FIELD]
    if unknown:
        raise ValueError(f"not load series: {unknown}; known: {', '.join(_FIELD)}")
    shown = shown_instances(f)
    load = lines(f)
    sources = load.sources
    covered = {name: {i for i in sources if name != "queue_depth" or sources[i] == KVPILOT_STEPS} for name in names}
    rows = [
        {
            "instance": inst,
            "line": inst,
            "ts": b.ts,
            "series": name,
            "value": value,
            "source": _source(sources[inst], b.rollup),
        }
        for inst, buckets in load.lines.items()
        for name in names
        if inst in covered[name] and (not load.fleet or inst in load.top[_FIELD[name]])
        for b in buckets
        if (value := getattr(b, _FIELD[name])) is not None
    ]
    rows += _fleet_rows(load, names)
    # only the instances a series has no steps for: a fleet of engines with steps reads no gauge at all
    wanted = tuple(sorted({i for name in names for i in shown if i not in covered[name]}))
    gauges = serving.gauges(f, names, agg="max", instances=wanted) if wanted else pd.DataFrame()
    if not gauges.empty:
        keep = [
            f.shows(inst) and inst not in covered[name]
            for inst, name in zip(gauges["instance"], gauges["series"], strict=True)
        ]
        sampled = gauges[keep]
        rows += [
            {
                "instance": r.instance,
                "line": r.line,
                "ts": r.ts,
                "series": r.series,
                "value": r.value,
                "source": SAMPLED,
            }
            for r in sampled.itertuples()
        ]
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["time"] = to_time(df["ts"])
    return df


def _fleet_rows(load: queries.LoadLines, names: tuple[str, ...]) -> list[dict]:
    """The envelope's two lines per series: the highest and the mean of the instances' peaks per bucket."""
    n = load.instances
    source = load.fleet_source()
    rows = []
    for name in names:
        field = _FIELD[name]
        for b in load.fleet:
            for line, value in ((f"fleet peak ({n} engines)", getattr(b, f"{field}_max")),
                                (f"fleet mean ({n} engines)", getattr(b, f"{field}_mean"))):  # fmt: skip
                if value is not None:
                    rows.append(
                        {"instance": FLEET, "line": line, "ts": b.ts, "series": name, "value": value, "source": source}
                    )
    return rows


def _source(steps_source: str, rollup: bool) -> str:
    return f"{steps_source}; {ROLLUP_NOTE}" if rollup else steps_source


def figure(what: str, value: str, source: str) -> str:
    """`what` with its value and source: a peak when it comes from every step, a sample's highest otherwise."""
    name = f"{what}, highest sample" if "sampled" in source else f"{what} peak"
    return f"{name} **{value}** ({source})"


def describe(df: pd.DataFrame, bucket: str) -> str:
    """A chart title's tail: what each point is, by where its line comes from."""
    found = set(df["source"]) if not df.empty else set()
    stepped = [s for kind in (VLLM_STEPS, KVPILOT_STEPS) for s in sorted(found) if s.startswith(kind)]
    parts = [f"peak per {bucket} over every step: {s}" for s in stepped]
    if SAMPLED in found:
        parts.append(f"highest sample per {bucket}: {SAMPLED}")
    return "; ".join(parts)
