"""Canonical series names and the one mapping from external Prometheus names to them (docs/architecture.md).

Every gauge or counter the collector stores, whether it came from an engine's own events or from a
scrape of kvpilot, vLLM, SGLang or an NVIDIA DCGM exporter, is stored and queried under a canonical
name in base units (fractions 0..1, bytes, seconds). Unit conversions happen here and nowhere else.

A stored series is (canonical name, instance, label set). The label set holds only the labels that
identify a series at its source, declared per source in `SOURCE_LABELS` (model and engine of vLLM,
model and ranks of SGLang, GPU, MIG instance and host of DCGM) and per family in `Mapping.keep_labels`
(`finished_reason`, `stage`, `direction`, ...). Everything else is dropped: info labels (`modelName`,
`pci_bus_id`, `DCGM_FI_DRIVER_VERSION`), Kubernetes pod labels, `le` outside histogram buckets, and
`_created` samples (no mapping names them). `instance` and `job` are never labels: instance has a
column of its own.

Histograms keep their buckets: `<base>_bucket` counters with `le`, next to `<base>_sum` and
`<base>_count`. `le` is normalised by `format_le` so buckets from different exporters compare equal.
Counters are stored as they come, resets included; the read side handles resets.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["gauge", "counter"]
Labels = collections.abc.Mapping[str, str]
MIB = 2**20


@dataclass(frozen=True)
class Canonical:
    name: str
    kind: Kind
    unit: str
    help: str


def _c(name: str, kind: Kind, unit: str, help_: str) -> Canonical:
    return Canonical(name, kind, unit, help_)


def _hc(base: str, sum_unit: str, count_unit: str, help_: str) -> tuple[Canonical, ...]:
    """A histogram's three canonical counters; a bucket counts observations, as `_count` does."""
    return (
        _c(f"{base}_bucket", "counter", count_unit, f"cumulative count of {help_} <= le"),
        _c(f"{base}_sum", "counter", sum_unit, f"sum of {help_}"),
        _c(f"{base}_count", "counter", count_unit, f"count of {help_}"),
    )


CANONICAL: dict[str, Canonical] = {
    c.name: c
    for c in (
        _c("utilization", "gauge", "ratio", "accelerator busy fraction 0..1"),
        _c("memory_used_bytes", "gauge", "bytes", "accelerator memory in use"),
        _c("memory_free_bytes", "gauge", "bytes", "accelerator memory free"),
        _c("memory_reserved_bytes", "gauge", "bytes", "accelerator memory reserved by the driver"),
        _c("memory_total_bytes", "gauge", "bytes", "accelerator memory capacity"),
        _c("memory_usage", "gauge", "ratio", "memory_used_bytes / memory_total_bytes (derived)"),
        _c("kv_usage", "gauge", "ratio", "fraction of hot KV cache in use"),
        _c("kv_cold_usage", "gauge", "ratio", "fraction of cold (CPU/swap) KV cache in use"),
        _c("kv_fragmentation", "gauge", "ratio", "free KV memory unusable for a new block"),
        _c("kv_internal_waste", "gauge", "ratio", "allocated KV slots holding no token"),
        _c("kv_used_tokens", "gauge", "tokens", "KV cache slots (tokens) in use"),
        _c("kv_total_tokens", "gauge", "tokens", "KV cache capacity in tokens"),
        _c("queue_depth", "gauge", "requests", "requests waiting to be scheduled"),
        _c("running", "gauge", "requests", "sequences running"),
        _c("swapped", "gauge", "requests", "sequences swapped out"),
        _c("swap_rate", "gauge", "1/s", "swaps per second"),
        _c("prefix_hit_rate", "gauge", "ratio", "prefix cache hit rate"),
        _c("kv_cache_config_info", "gauge", "info", "1, labelled with the engine's KV cache config (prefix caching)"),
        _c("generation_throughput", "gauge", "tokens/s", "tokens generated per second (engine's own estimate)"),
        _c("gpu_power_watts", "gauge", "watts", "accelerator power draw"),
        _c("gpu_temperature_celsius", "gauge", "celsius", "accelerator temperature"),
        _c("swaps_total", "counter", "swaps", "KV swaps (label direction)"),
        _c("preemptions_total", "counter", "preemptions", "sequences preempted"),
        _c("requests_total", "counter", "requests", "requests that left the engine (label status)"),
        _c("requests_rejected_total", "counter", "requests", "requests refused at admission"),
        _c("oom_total", "counter", "events", "KV allocations that failed"),
        _c("events_lost_total", "counter", "events", "telemetry events a sink lost (labels kind, reason)"),
        _c("prompt_tokens_total", "counter", "tokens", "prompt tokens processed"),
        _c("generation_tokens_total", "counter", "tokens", "tokens generated"),
        _c("prefix_cache_queries_total", "counter", "tokens", "prefix cache lookups"),
        _c("prefix_cache_hits_total", "counter", "tokens", "prefix cache hits"),
        *_hc("ttft_seconds", "seconds", "requests", "time to first token"),
        *_hc("itl_seconds", "seconds", "tokens", "inter-token latency"),
        *_hc("e2e_seconds", "seconds", "requests", "end-to-end latency"),
        *_hc("queue_time_seconds", "seconds", "requests", "queue time"),
        *_hc("prefill_time_seconds", "seconds", "requests", "time in prefill"),
        *_hc("decode_time_seconds", "seconds", "requests", "time in decode"),
        *_hc("inference_time_seconds", "seconds", "requests", "time running (prefill + decode)"),
        *_hc("stage_latency_seconds", "seconds", "requests", "per-stage request latency (label stage)"),
        *_hc("request_prompt_tokens", "tokens", "requests", "prompt tokens per request"),
        *_hc("request_generation_tokens", "tokens", "requests", "generated tokens per request"),
        *_hc("iteration_tokens", "tokens", "steps", "tokens per engine iteration"),
        _c("up", "gauge", "bool", "1 if the last scrape of the target succeeded"),
        _c("scrape_duration_seconds", "gauge", "seconds", "how long the scrape took"),
        _c("scrape_series_dropped", "gauge", "series", "series of the scrape not stored (cardinality bounds)"),
        # Derived from engine step events (not scraped).
        _c("step_duration_seconds", "gauge", "seconds", "engine iteration wall time"),
        _c("batch_size", "gauge", "sequences", "sequences in the engine iteration"),
        _c("step_tokens", "gauge", "tokens", "prefill + decode tokens in the iteration"),
        _c("kv_blocks_used", "gauge", "blocks", "KV pages in use after the iteration"),
    )
}


# --- which labels identify a series ----------------------------------------------------------------


@dataclass(frozen=True)
class SourceLabels:
    """The identifying labels of every family of one source, in their one stored spelling.

    `rename` maps other spellings seen in the field to the stored one (applied before `keep`).
    """

    keep: frozenset[str]
    rename: Labels = field(default_factory=dict)


SOURCE_LABELS: dict[str, SourceLabels] = {
    # kvpilot's engine labels only what the family itself declares (direction, status).
    "kvpilot": SourceLabels(frozenset()),
    # vLLM v1: every family carries model_name and engine (the data-parallel engine index).
    "vllm": SourceLabels(frozenset({"model_name", "engine"})),
    # SGLang schedulers label model_name, engine_type, tp_rank, pp_rank and (with DP attention) dp_rank:
    # two schedulers of one server differ only by a rank, so every rank is kept. engine_type tells a
    # prefill server from a decode one (PD disaggregation). moe_ep_rank follows from tp_rank: dropped.
    "sglang": SourceLabels(frozenset({"model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"})),
    # dcgm-exporter: gpu (index) and UUID name the GPU, GPU_I_ID / GPU_I_PROFILE the MIG instance, hostname
    # the node. `device` (nvidia0), `pci_bus_id` and `modelName` are fixed per GPU (no series differs by them
    # alone) and `DCGM_FI_DRIVER_VERSION` or pod labels are information, so they are dropped; the link
    # families even spell the GPU model `model_name`, which would read as the engines' served model.
    # dcgm-exporter wrote `Hostname` before its PR #655 and `hostname` since (one case, like its other
    # labels); `uuid` is its --use-old-namespace spelling of `UUID`. Stored: `hostname` and `UUID`.
    "dcgm": SourceLabels(
        frozenset({"gpu", "UUID", "hostname", "GPU_I_ID", "GPU_I_PROFILE"}),
        rename={"Hostname": "hostname", "uuid": "UUID"},
    ),
}


@dataclass(frozen=True)
class Derived:
    """A label computed from another label's value (or a constant when `source` is None)."""

    target: str
    source: str | None
    values: tuple[tuple[str, str], ...] = ()
    default: str = ""

    def value(self, labels: Labels) -> str:
        found = labels.get(self.source, "") if self.source else ""
        return dict(self.values).get(found, self.default)


# vLLM counts every request that left the engine in request_success_total, aborted ones included
# (finished_reason="abort"). Stored as requests_total with kvpilot's status: stop, length, repetition
# (and any future reason) are `finished`, abort is `aborted`, error is `failed`; finished_reason is kept.
_VLLM_STATUS = Derived("status", "finished_reason", (("abort", "aborted"), ("error", "failed")), "finished")
_ABORTED = Derived("status", None, default="aborted")


@dataclass(frozen=True)
class Mapping:
    """One external sample name -> one canonical series.

    `scale` converts the value to base units; for a `_bucket` family (`le_scale` set) the value is a
    count and stays, while `le` is scaled instead. `keep_labels` adds identifying labels of this family
    to its source's (`SOURCE_LABELS`). `origin` is the external family a histogram sample belongs to.
    """

    source: str
    external: str
    canonical: str
    scale: float = 1.0
    keep_labels: tuple[str, ...] = ()
    le_scale: float | None = None
    derive: Derived | None = None
    origin: str = ""


def _m(
    source: str,
    external: str,
    canonical: str,
    scale: float = 1.0,
    keep: tuple[str, ...] = (),
    derive: Derived | None = None,
) -> Mapping:
    return Mapping(source, external, canonical, scale, keep, derive=derive, origin=external)


def _hist(source: str, external: str, canonical: str, scale: float = 1.0, keep: tuple[str, ...] = ()) -> list[Mapping]:
    """`_bucket` (le scaled), `_sum` (value scaled) and `_count` of one external histogram."""
    return [
        Mapping(source, f"{external}_bucket", f"{canonical}_bucket", 1.0, keep, le_scale=scale, origin=external),
        Mapping(source, f"{external}_sum", f"{canonical}_sum", scale, keep, origin=external),
        Mapping(source, f"{external}_count", f"{canonical}_count", 1.0, keep, origin=external),
    ]


# When two external families land on one stored series in one scrape (a renamed metric next to its
# deprecated name, GPU_UTIL next to GR_ENGINE_ACTIVE), the family declared first here wins for that label
# set and the other is dropped whole, buckets included: current names are declared before old ones.
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
    # vLLM (v1 names, then the deprecated and v0 names still seen in the field). `*_perc` gauges are 0..1.
    _m("vllm", "vllm:num_requests_running", "running"),
    _m("vllm", "vllm:num_requests_waiting", "queue_depth"),
    _m("vllm", "vllm:num_requests_swapped", "swapped"),
    _m("vllm", "vllm:kv_cache_usage_perc", "kv_usage"),
    _m("vllm", "vllm:gpu_cache_usage_perc", "kv_usage"),
    _m("vllm", "vllm:cpu_cache_usage_perc", "kv_cold_usage"),
    _m("vllm", "vllm:gpu_prefix_cache_hit_rate", "prefix_hit_rate"),
    _m("vllm", "vllm:prefix_cache_queries_total", "prefix_cache_queries_total"),
    _m("vllm", "vllm:gpu_prefix_cache_queries_total", "prefix_cache_queries_total"),
    _m("vllm", "vllm:prefix_cache_hits_total", "prefix_cache_hits_total"),
    _m("vllm", "vllm:gpu_prefix_cache_hits_total", "prefix_cache_hits_total"),
    # An info gauge (always 1): its labels say whether prefix caching is on and the block size and count.
    _m(
        "vllm",
        "vllm:cache_config_info",
        "kv_cache_config_info",
        keep=("enable_prefix_caching", "block_size", "num_gpu_blocks"),
    ),
    _m("vllm", "vllm:num_preemptions_total", "preemptions_total"),
    _m("vllm", "vllm:prompt_tokens_total", "prompt_tokens_total"),
    _m("vllm", "vllm:generation_tokens_total", "generation_tokens_total"),
    _m("vllm", "vllm:request_success_total", "requests_total", keep=("finished_reason",), derive=_VLLM_STATUS),
    *_hist("vllm", "vllm:time_to_first_token_seconds", "ttft_seconds"),
    *_hist("vllm", "vllm:inter_token_latency_seconds", "itl_seconds"),
    *_hist("vllm", "vllm:time_per_output_token_seconds", "itl_seconds"),
    *_hist("vllm", "vllm:e2e_request_latency_seconds", "e2e_seconds"),
    *_hist("vllm", "vllm:request_queue_time_seconds", "queue_time_seconds"),
    *_hist("vllm", "vllm:request_prefill_time_seconds", "prefill_time_seconds"),
    *_hist("vllm", "vllm:request_decode_time_seconds", "decode_time_seconds"),
    *_hist("vllm", "vllm:request_inference_time_seconds", "inference_time_seconds"),
    *_hist("vllm", "vllm:request_prompt_tokens", "request_prompt_tokens"),
    *_hist("vllm", "vllm:request_generation_tokens", "request_generation_tokens"),
    *_hist("vllm", "vllm:iteration_tokens_total", "iteration_tokens"),
    # SGLang. num_requests_total counts every request that left, aborted ones too, so it is not mapped
    # to a status; num_aborted_requests_total is. cached_tokens_total counts prompt tokens served from
    # the radix cache, vLLM's prefix cache hits in tokens.
    _m("sglang", "sglang:num_running_reqs", "running"),
    _m("sglang", "sglang:num_queue_reqs", "queue_depth"),
    _m("sglang", "sglang:token_usage", "kv_usage"),
    _m("sglang", "sglang:num_used_tokens", "kv_used_tokens"),
    _m("sglang", "sglang:max_total_num_tokens", "kv_total_tokens"),
    _m("sglang", "sglang:cache_hit_rate", "prefix_hit_rate"),
    _m("sglang", "sglang:gen_throughput", "generation_throughput"),
    _m("sglang", "sglang:prompt_tokens_total", "prompt_tokens_total"),
    _m("sglang", "sglang:generation_tokens_total", "generation_tokens_total"),
    _m("sglang", "sglang:cached_tokens_total", "prefix_cache_hits_total"),
    _m("sglang", "sglang:num_retracted_requests_total", "preemptions_total"),
    _m("sglang", "sglang:num_aborted_requests_total", "requests_total", derive=_ABORTED),
    *_hist("sglang", "sglang:time_to_first_token_seconds", "ttft_seconds"),
    *_hist("sglang", "sglang:inter_token_latency_seconds", "itl_seconds"),
    *_hist("sglang", "sglang:time_per_output_token_seconds", "itl_seconds"),
    *_hist("sglang", "sglang:e2e_request_latency_seconds", "e2e_seconds"),
    *_hist("sglang", "sglang:queue_time_seconds", "queue_time_seconds"),
    *_hist("sglang", "sglang:per_stage_req_latency_seconds", "stage_latency_seconds", keep=("stage",)),
    # NVIDIA DCGM exporter: GPU_UTIL is a percent, FB_* are MiB. GPU_UTIL is not reported for MIG
    # instances; GR_ENGINE_ACTIVE (a 0..1 ratio) is, and stands in for it where GPU_UTIL is absent.
    _m("dcgm", "DCGM_FI_DEV_GPU_UTIL", "utilization", scale=0.01),
    _m("dcgm", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "utilization"),
    _m("dcgm", "DCGM_FI_DEV_FB_USED", "memory_used_bytes", scale=MIB),
    _m("dcgm", "DCGM_FI_DEV_FB_FREE", "memory_free_bytes", scale=MIB),
    _m("dcgm", "DCGM_FI_DEV_FB_RESERVED", "memory_reserved_bytes", scale=MIB),
    _m("dcgm", "DCGM_FI_DEV_FB_TOTAL", "memory_total_bytes", scale=MIB),
    _m("dcgm", "DCGM_FI_DEV_POWER_USAGE", "gpu_power_watts"),
    _m("dcgm", "DCGM_FI_DEV_GPU_TEMP", "gpu_temperature_celsius"),
)

BY_EXTERNAL: dict[str, Mapping] = {m.external: m for m in MAPPINGS}
_unmapped = [m.external for m in MAPPINGS if m.canonical not in CANONICAL or m.source not in SOURCE_LABELS]
if _unmapped:
    raise ValueError(f"mappings target unknown canonical series or sources: {_unmapped}")
# Precedence of an external family among those landing on the same canonical family: declaration order.
FAMILY_RANK: dict[str, int] = {}
for _i, _mapping in enumerate(MAPPINGS):
    FAMILY_RANK.setdefault(_mapping.origin, _i)


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
