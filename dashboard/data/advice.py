"""Advice in the engine's own words: which engine each instance runs (collector.queries.engine_infos), and
the knob text for it. vLLM is tuned by its command-line flags, kvpilot's engine by its config keys; telling a
vLLM that already caches prefixes to enable kvpilot's prefix cache is advice nobody can follow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import streamlit as st

from collector import queries
from dashboard.data.base import TTL_S, Filters, engine

KVPILOT_PREFIX_KEY = "cache.enable_prefix_cache: true"
VLLM_PREFIX_FLAG = "--enable-prefix-caching"


@st.cache_data(ttl=TTL_S, show_spinner=False)
def engines(url: str, instances: tuple[str, ...]) -> dict[str, queries.EngineInfo]:
    return queries.engine_infos(engine(url), instances=instances)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def prefix_hits(f: Filters, instances: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """instance -> (prompt tokens that hit the prefix cache, tokens looked up) over the window, from the
    scraped counters (vLLM v1 counts hits; it has no hit-rate gauge). Instances without them are left out."""
    db, out = engine(f.db_url), {}
    for inst in instances:
        looked = queries.counter_increase(
            db, name="prefix_cache_queries_total", start=f.start, end=f.end, instances=[inst]
        )
        hits = queries.counter_increase(db, name="prefix_cache_hits_total", start=f.start, end=f.end, instances=[inst])
        if looked:
            out[inst] = (sum(hits.values()), sum(looked.values()))
    return out


def prefix_cache_hint(infos: Sequence[queries.EngineInfo], hits: dict[str, tuple[float, float]]) -> str:
    """What to do about a missing prefix-cache hit rate, per instance in its engine's terms. Instances whose
    engine is not known (a GPU exporter among them) get nothing of their own; when no engine is known, one line
    names both engines' switches."""
    lines = []
    unknown = [info.instance for info in infos if info.engine is None]
    for info in (i for i in infos if i.engine is not None):
        name = f"`{info.instance}`"
        if info.engine == "vllm" and info.prefix_caching:
            said = (
                f"{name}: prefix caching is on (vLLM `{VLLM_PREFIX_FLAG}`); vLLM counts hits rather than report a rate"
            )
            hit, looked = hits.get(info.instance, (0.0, 0.0))
            lines.append(
                f"{said}: {hit / looked:.0%} of {looked:,.0f} prompt tokens looked up hit the cache in this window."
                if looked
                else f"{said}, and no lookup was counted in this window."
            )
        elif info.engine == "vllm" and info.prefix_caching is False:
            lines.append(f"{name}: start vLLM with `{VLLM_PREFIX_FLAG}` to reuse shared prompt prefixes.")
        elif info.engine == "vllm":
            lines.append(
                f"{name}: vLLM's prefix cache is `{VLLM_PREFIX_FLAG}`; whether it is on is not stored (its "
                "`vllm:cache_config_info` was not scraped)."
            )
        elif info.engine == "kvpilot":
            lines.append(f"{name}: enable the prefix cache (`{KVPILOT_PREFIX_KEY}`) to see it.")
        elif info.engine == "sglang":
            lines.append(f"{name}: SGLang's radix cache is on unless started with `--disable-radix-cache`.")
    if unknown and not lines:
        lines.append(f"kvpilot's engine: `{KVPILOT_PREFIX_KEY}`; vLLM: `{VLLM_PREFIX_FLAG}`.")
    return " ".join(lines)


def alloc_trace_hint(infos: Sequence[queries.EngineInfo]) -> str:
    """Why there is no allocation trace: kvpilot's engine sends one when asked; vLLM keeps none."""
    vllm = ", ".join(f"`{i.instance}`" for i in infos if i.engine == "vllm")
    kvpilot = "The trace (alloc/free/swap/evict events) comes from kvpilot's engine with `telemetry.trace_alloc: true`"
    if vllm and all(i.engine == "vllm" for i in infos):
        return f"vLLM keeps no per-block allocation trace ({vllm}): its KV usage is charted above. {kvpilot}."
    return kvpilot + (f"; vLLM ({vllm}) keeps none." if vllm else ".")


def knob_text(knob: queries.Knob, engine_name: str | None) -> str:
    """The knob a finding points at, named as its engine names it (both where the engine is not known)."""
    if engine_name == "vllm":
        return f"**Knob (vLLM):** {_flags(knob.vllm)}: {knob.why}. (kvpilot's engine calls it `{knob.name}`.)"
    if engine_name == "kvpilot":
        return f"**Knob:** `{knob.name}`: {knob.why}."
    return f"**Knob:** `{knob.name}` in kvpilot's engine; vLLM: {_flags(knob.vllm)}. {knob.why.capitalize()}."


def _flags(text: str) -> str:
    """vLLM's flags in a knob's text as code: `--max-num-seqs`."""
    return re.sub(r"(?<![`\w])(--[a-z0-9][a-z0-9-]*)", r"`\1`", text)


def study_caption(knob: queries.Knob, engine_name: str | None, has_command: bool) -> str:
    """What the study command does, or why there is none, for the finding's engine."""
    if engine_name == "vllm":
        if has_command:
            return (
                "A study of this vLLM's own arguments, replaying its stored requests (`--config`: the running "
                "vLLM's config file, in vLLM's `--config` form):"
            )
        return f"No study searches this on vLLM; vLLM: {_flags(knob.vllm)}."
    if has_command:
        return "A tuning study over exactly this knob, replaying this instance's stored traffic on the simulator:"
    return (
        f"`{knob.name}` is not hot-reloadable, so no study can search it: set it in the engine config "
        "(`kvpilot engine serve --config`) and restart."
    )
