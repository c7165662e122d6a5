"""Canonical series names and the one mapping from external Prometheus names to them (DESIGN.md).

Every gauge or counter the collector stores, whether it came from an engine's own events or from a
scrape of kvpilot, vLLM, SGLang or an NVIDIA DCGM exporter, is stored and queried under a canonical
name in base units (fractions 0..1, bytes, seconds). Unit conversions happen here and nowhere else.

Histograms are kept as their `_sum` and `_count` counters (`ttft_seconds_sum`, `ttft_seconds_count`):
enough for mean latency over any window; exact percentiles come from the per-request events instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter"]
MIB = 2**20


@dataclass(frozen=True)
class Canonical:
    name: str
    kind: Kind
    unit: str
    help: str


def _c(name: str, kind: Kind, unit: str, help_: str) -> Canonical:
    return Canonical(name, kind, unit, help_)


CANONICAL: dict[str, Canonical] = {
    c.name: c
    for c in (
        _c("utilization", "gauge", "ratio", "accelerator busy fraction 0..1"),
        _c("memory_used_bytes", "gauge", "bytes", "accelerator memory in use"),
        _c("memory_free_bytes", "gauge", "bytes", "accelerator memory free"),
        _c("memory_total_bytes", "gauge", "bytes", "accelerator memory capacity"),
        _c("memory_usage", "gauge", "ratio", "memory_used_bytes / memory_total_bytes (derived)"),
        _c("kv_usage", "gauge", "ratio", "fraction of hot KV cache in use"),
        _c("kv_cold_usage", "gauge", "ratio", "fraction of cold (CPU/swap) KV cache in use"),
        _c("kv_fragmentation", "gauge", "ratio", "free KV memory unusable for a new block"),
        _c("kv_internal_waste", "gauge", "ratio", "allocated KV slots holding no token"),
        _c("queue_depth", "gauge", "requests", "requests waiting to be scheduled"),
        _c("running", "gauge", "requests", "sequences running"),
        _c("swapped", "gauge", "requests", "sequences swapped out"),
        _c("swap_rate", "gauge", "1/s", "swaps per second"),
        _c("prefix_hit_rate", "gauge", "ratio", "prefix cache hit rate"),
        _c("gpu_power_watts", "gauge", "watts", "accelerator power draw"),
        _c("gpu_temperature_celsius", "gauge", "celsius", "accelerator temperature"),
        _c("swaps_total", "counter", "swaps", "KV swaps (label direction)"),
        _c("preemptions_total", "counter", "preemptions", "sequences preempted"),
        _c("requests_total", "counter", "requests", "requests finished (label status)"),
        _c("requests_rejected_total", "counter", "requests", "requests refused at admission"),
        _c("oom_total", "counter", "events", "KV allocations that failed"),
        _c("prompt_tokens_total", "counter", "tokens", "prompt tokens processed"),
        _c("generation_tokens_total", "counter", "tokens", "tokens generated"),
        _c("prefix_cache_queries_total", "counter", "tokens", "prefix cache lookups"),
        _c("prefix_cache_hits_total", "counter", "tokens", "prefix cache hits"),
        _c("ttft_seconds_sum", "counter", "seconds", "sum of time to first token"),
        _c("ttft_seconds_count", "counter", "requests", "count of time to first token"),
        _c("itl_seconds_sum", "counter", "seconds", "sum of inter-token latency"),
        _c("itl_seconds_count", "counter", "tokens", "count of inter-token latency"),
        _c("e2e_seconds_sum", "counter", "seconds", "sum of end-to-end latency"),
        _c("e2e_seconds_count", "counter", "requests", "count of end-to-end latency"),
        _c("queue_time_seconds_sum", "counter", "seconds", "sum of queue time"),
        _c("queue_time_seconds_count", "counter", "requests", "count of queue time"),
        _c("up", "gauge", "bool", "1 if the last scrape of the target succeeded"),
        _c("scrape_duration_seconds", "gauge", "seconds", "how long the scrape took"),
        # Derived from engine step events (not scraped).
        _c("step_duration_seconds", "gauge", "seconds", "engine iteration wall time"),
        _c("batch_size", "gauge", "sequences", "sequences in the engine iteration"),
        _c("step_tokens", "gauge", "tokens", "prefill + decode tokens in the iteration"),
        _c("kv_blocks_used", "gauge", "blocks", "KV pages in use after the iteration"),
    )
}


@dataclass(frozen=True)
class Mapping:
    source: str
    external: str
    canonical: str
    scale: float = 1.0
    keep_labels: tuple[str, ...] = ()


def _m(source: str, external: str, canonical: str, scale: float = 1.0, keep: tuple[str, ...] = ()) -> Mapping:
    return Mapping(source, external, canonical, scale, keep)


def _hist(source: str, external: str, canonical: str) -> list[Mapping]:
    return [_m(source, f"{external}_sum", f"{canonical}_sum"), _m(source, f"{external}_count", f"{canonical}_count")]


_GPU = ("gpu",)

MAPPINGS: tuple[Mapping, ...] = (
    # kvpilot's own engine /metrics
    _m("kvpilot", "kvpilot_queue_depth", "queue_depth"),
    _m("kvpilot", "kvpilot_running_seqs", "running"),
    _m("kvpilot", "kvpilot_swapped_seqs", "swapped"),
    _m("kvpilot", "kvpilot_kv_usage", "kv_usage"),
    _m("kvpilot", "kvpilot_kv_cold_usage", "kv_cold_usage"),
    _m("kvpilot", "kvpilot_kv_fragmentation", "kv_fragmentation"),
    _m("kvpilot", "kvpilot_kv_internal_waste", "kv_internal_waste"),
    _m("kvpilot", "kvpilot_utilization", "utilization"),
    _m("kvpilot", "kvpilot_memory_used_bytes", "memory_used_bytes"),
    _m("kvpilot", "kvpilot_memory_total_bytes", "memory_total_bytes"),
    _m("kvpilot", "kvpilot_swaps_total", "swaps_total", keep=("direction",)),
    _m("kvpilot", "kvpilot_preemptions_total", "preemptions_total"),
    _m("kvpilot", "kvpilot_requests_total", "requests_total", keep=("status",)),
    _m("kvpilot", "kvpilot_rejected_total", "requests_rejected_total"),
    _m("kvpilot", "kvpilot_oom_total", "oom_total"),
    _m("kvpilot", "kvpilot_prompt_tokens_total", "prompt_tokens_total"),
    _m("kvpilot", "kvpilot_generation_tokens_total", "generation_tokens_total"),
    *_hist("kvpilot", "kvpilot_time_to_first_token_seconds", "ttft_seconds"),
    *_hist("kvpilot", "kvpilot_inter_token_latency_seconds", "itl_seconds"),
    *_hist("kvpilot", "kvpilot_e2e_request_latency_seconds", "e2e_seconds"),
    *_hist("kvpilot", "kvpilot_queue_time_seconds", "queue_time_seconds"),
    # vLLM (v1 names, and the v0 names still seen in the field). `*_perc` gauges are already 0..1.
    _m("vllm", "vllm:num_requests_running", "running"),
    _m("vllm", "vllm:num_requests_waiting", "queue_depth"),
    _m("vllm", "vllm:num_requests_swapped", "swapped"),
    _m("vllm", "vllm:kv_cache_usage_perc", "kv_usage"),
    _m("vllm", "vllm:gpu_cache_usage_perc", "kv_usage"),
    _m("vllm", "vllm:cpu_cache_usage_perc", "kv_cold_usage"),
    _m("vllm", "vllm:gpu_prefix_cache_hit_rate", "prefix_hit_rate"),
    _m("vllm", "vllm:prefix_cache_queries_total", "prefix_cache_queries_total"),
    _m("vllm", "vllm:prefix_cache_hits_total", "prefix_cache_hits_total"),
    _m("vllm", "vllm:num_preemptions_total", "preemptions_total"),
    _m("vllm", "vllm:prompt_tokens_total", "prompt_tokens_total"),
    _m("vllm", "vllm:generation_tokens_total", "generation_tokens_total"),
    _m("vllm", "vllm:request_success_total", "requests_total", keep=("finished_reason",)),
    *_hist("vllm", "vllm:time_to_first_token_seconds", "ttft_seconds"),
    *_hist("vllm", "vllm:inter_token_latency_seconds", "itl_seconds"),
    *_hist("vllm", "vllm:time_per_output_token_seconds", "itl_seconds"),
    *_hist("vllm", "vllm:e2e_request_latency_seconds", "e2e_seconds"),
    *_hist("vllm", "vllm:request_queue_time_seconds", "queue_time_seconds"),
    # SGLang
    _m("sglang", "sglang:num_running_reqs", "running"),
    _m("sglang", "sglang:num_queue_reqs", "queue_depth"),
    _m("sglang", "sglang:token_usage", "kv_usage"),
    _m("sglang", "sglang:cache_hit_rate", "prefix_hit_rate"),
    _m("sglang", "sglang:prompt_tokens_total", "prompt_tokens_total"),
    _m("sglang", "sglang:generation_tokens_total", "generation_tokens_total"),
    *_hist("sglang", "sglang:time_to_first_token_seconds", "ttft_seconds"),
    *_hist("sglang", "sglang:inter_token_latency_seconds", "itl_seconds"),
    *_hist("sglang", "sglang:time_per_output_token_seconds", "itl_seconds"),
    *_hist("sglang", "sglang:e2e_request_latency_seconds", "e2e_seconds"),
    # NVIDIA DCGM exporter: GPU_UTIL is a percent, FB_* are MiB.
    _m("dcgm", "DCGM_FI_DEV_GPU_UTIL", "utilization", scale=0.01, keep=_GPU),
    _m("dcgm", "DCGM_FI_DEV_FB_USED", "memory_used_bytes", scale=MIB, keep=_GPU),
    _m("dcgm", "DCGM_FI_DEV_FB_FREE", "memory_free_bytes", scale=MIB, keep=_GPU),
    _m("dcgm", "DCGM_FI_DEV_FB_TOTAL", "memory_total_bytes", scale=MIB, keep=_GPU),
    _m("dcgm", "DCGM_FI_DEV_POWER_USAGE", "gpu_power_watts", keep=_GPU),
    _m("dcgm", "DCGM_FI_DEV_GPU_TEMP", "gpu_temperature_celsius", keep=_GPU),
)

BY_EXTERNAL: dict[str, Mapping] = {m.external: m for m in MAPPINGS}
_unmapped = [m.external for m in MAPPINGS if m.canonical not in CANONICAL]
if _unmapped:
    raise ValueError(f"mappings target unknown canonical series: {_unmapped}")


@dataclass(frozen=True)
class Point:
    name: str
    labels: str
    value: float


def labels_json(labels: dict[str, str]) -> str:
    """The stored form of a label set: sorted compact JSON, so equal sets compare equal in SQL."""
    return json.dumps(dict(sorted(labels.items())), separators=(",", ":"))


def map_samples(samples: list[tuple[str, dict[str, str], float]]) -> list[Point]:
    """External (name, labels, value) samples -> canonical points; unknown names are skipped.

    DCGM reports used and free but usually not total, so total is derived per GPU when missing.
    """
    points: list[Point] = []
    dcgm_mem: dict[str, dict[str, float]] = {}
    for name, labels, value in samples:
        mapping = BY_EXTERNAL.get(name)
        if mapping is None or value != value:  # unknown or NaN
            continue
        kept = {k: labels[k] for k in mapping.keep_labels if k in labels}
        scaled = value * mapping.scale
        points.append(Point(mapping.canonical, labels_json(kept), scaled))
        if mapping.source == "dcgm" and mapping.canonical.startswith("memory_"):
            dcgm_mem.setdefault(labels_json(kept), {})[mapping.canonical] = scaled
    for lab, mem in dcgm_mem.items():
        if "memory_total_bytes" not in mem and {"memory_used_bytes", "memory_free_bytes"} <= mem.keys():
            points.append(Point("memory_total_bytes", lab, mem["memory_used_bytes"] + mem["memory_free_bytes"]))
    return points


# Canonical series served from engine event tables: name -> (table, column).
SAMPLE_COLUMNS: dict[str, str] = {
    "utilization": "utilization",
    "memory_used_bytes": "memory_used_bytes",
    "memory_total_bytes": "memory_total_bytes",
    "kv_usage": "kv_usage",
    "kv_cold_usage": "cold_usage",
    "kv_fragmentation": "fragmentation",
    "kv_internal_waste": "internal_waste",
    "queue_depth": "queue_depth",
    "running": "running",
    "swap_rate": "swap_rate",
    "prefix_hit_rate": "prefix_hit_rate",
}
STEP_COLUMNS: dict[str, str] = {
    "step_duration_seconds": "duration_s",
    "batch_size": "num_seqs",
    "step_tokens": "prefill_tokens + decode_tokens",
    "kv_blocks_used": "kv_blocks_used",
}
DERIVED = ("memory_usage",)


def list_series_names() -> list[str]:
    """Every canonical series name `collector.queries.series_points` answers for."""
    return sorted(CANONICAL)
