"""Advice in the engine's own words (dashboard.data.advice): the prefix-cache hint and the knob text per engine."""

from __future__ import annotations

from collector import queries as q
from dashboard.data import advice


def _info(instance: str, engine: q.EngineName | None, on: bool | None) -> q.EngineInfo:
    return q.EngineInfo(instance, engine, on, "test")


def test_prefix_cache_hint_speaks_each_engines_language() -> None:
    on = advice.prefix_cache_hint([_info("v1", "vllm", True)], {"v1": (250.0, 1000.0)})
    assert on == (
        "`v1`: prefix caching is on (vLLM `--enable-prefix-caching`); vLLM counts hits rather than report a rate: "
        "25% of 1,000 prompt tokens looked up hit the cache in this window."
    )
    assert "no lookup was counted" in advice.prefix_cache_hint([_info("v1", "vllm", True)], {})
    off = advice.prefix_cache_hint([_info("v2", "vllm", False), _info("gpu", None, None)], {})
    assert off == "`v2`: start vLLM with `--enable-prefix-caching` to reuse shared prompt prefixes."
    assert "not stored" in advice.prefix_cache_hint([_info("v3", "vllm", None)], {})
    kv = advice.prefix_cache_hint([_info("e0", "kvpilot", None)], {})
    assert kv == "`e0`: enable the prefix cache (`cache.enable_prefix_cache: true`) to see it."
    assert advice.prefix_cache_hint([_info("gpu", None, None)], {}) == (
        "kvpilot's engine: `cache.enable_prefix_cache: true`; vLLM: `--enable-prefix-caching`."
    )


def test_knob_text_names_the_engines_own_knob() -> None:
    knob = q.KNOBS["scheduler.max_num_seqs"]
    assert advice.knob_text(knob, "vllm").startswith(
        "**Knob (vLLM):** `--max-num-seqs` (and `--gpu-memory-utilization`"
    )
    assert advice.knob_text(knob, "kvpilot").startswith("**Knob:** `scheduler.max_num_seqs`: fewer sequences")
    both = advice.knob_text(knob, None)
    assert "`scheduler.max_num_seqs` in kvpilot's engine" in both and "vLLM: `--max-num-seqs`" in both
    warmup = q.KNOBS["warmup.requests"]
    assert advice.study_caption(warmup, "vllm", has_command=False).startswith("No study searches this on vLLM")
    assert "kvpilot engine serve --config" in advice.study_caption(warmup, "kvpilot", has_command=False)


def test_alloc_trace_hint_does_not_send_a_vllm_to_kvpilots_config() -> None:
    only_vllm = advice.alloc_trace_hint([_info("v1", "vllm", True)])
    assert only_vllm.startswith("vLLM keeps no per-block allocation trace (`v1`)")
    mixed = advice.alloc_trace_hint([_info("e0", "kvpilot", None), _info("v1", "vllm", True)])
    assert mixed.startswith("The trace (alloc/free/swap/evict events) comes from kvpilot's engine with `telemetry")
    assert mixed.endswith("; vLLM (`v1`) keeps none.")
