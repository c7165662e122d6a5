"""Scraped-only instances for the dashboard seed, stored as the scraper stores them (`series_points` rows).

- `vllm-a` (job vllm): a vLLM server with two engines, each its own label set (engine, model_name):
  queue, running and KV gauges, request/token/preemption counters, and a TTFT histogram
  (`_bucket{le}`, `_sum`, `_count`); prefix caching on (`cache_config_info`) with 40% of lookups hitting.
- `dcgm-node1` (job dcgm, static target label node=node-1): a DCGM exporter with two GPUs, GPU 0 at 95%
  of its memory and GPU 1 at 75%; their average (85%) is what the dashboard must never show.

Scrapes every 15 s from T0, inside the pushed run's window; counters grow by the same step each scrape.
"""

from __future__ import annotations

import math
from typing import Any

from collector.exposition import labels_json
from tests.collector import evfactory as ev

T0 = ev.T0
SCRAPE_S = 15.0
SCRAPES = 20
GIB = 2**30
GPU_TOTAL_BYTES = 80 * GIB
GPU_MEMORY = {"0": 0.95, "1": 0.75}
GPU_UTILIZATION = {"0": 0.9, "1": 0.3}
NODE = "node-1"

ENGINES = {"0": {"engine": "0", "model_name": "m"}, "1": {"engine": "1", "model_name": "m"}}
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)
# TTFT observations per scrape interval: engine 0 is fast, engine 1 slow.
TTFT_PER_SCRAPE = {"0": [0.02] * 6 + [0.04] * 3 + [0.2], "1": [0.3] * 3 + [0.8, 2.0]}
# Per scrape interval and engine: (queue depth, running, KV usage, finished 'stop', finished 'abort',
# generation tokens, prompt tokens, preemptions).
PREFIX_CONFIG = {"enable_prefix_caching": "True", "block_size": "16", "num_gpu_blocks": "1000"}
PREFIX_LOOKUPS, PREFIX_HITS = 1000, 400  # prompt tokens per scrape interval and engine: 40% hit
ENGINE_STEP = {"0": (3, 8, 0.92, 9, 1, 1000, 2000, 1), "1": (1, 4, 0.40, 5, 0, 500, 1000, 0)}


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def _row(instance: str, name: str, labels: dict[str, str], k: int, value: float) -> dict[str, Any]:
    return {"instance": instance, "name": name, "labels": labels_json(labels), "ts": T0 + SCRAPE_S * k, "value": value}


def _vllm(k: int, target_id: int) -> list[dict[str, Any]]:
    rows = []
    for engine, labels in ENGINES.items():
        queue, running, kv, stop, abort, gen, prompt, preempt = ENGINE_STEP[engine]
        rows += [
            _row("vllm-a", "queue_depth", labels, k, queue),
            _row("vllm-a", "running", labels, k, running),
            _row("vllm-a", "kv_usage", labels, k, kv),
            _row("vllm-a", "requests_total", {**labels, "finished_reason": "stop"}, k, stop * k),
            _row("vllm-a", "requests_total", {**labels, "finished_reason": "abort"}, k, abort * k),
            _row("vllm-a", "generation_tokens_total", labels, k, gen * k),
            _row("vllm-a", "prompt_tokens_total", labels, k, prompt * k),
            _row("vllm-a", "preemptions_total", labels, k, preempt * k),
            # prefix caching on: vLLM says so in cache_config_info and counts hits (no hit-rate gauge)
            _row("vllm-a", "kv_cache_config_info", {"engine": engine, **PREFIX_CONFIG}, k, 1.0),
            _row("vllm-a", "prefix_cache_queries_total", labels, k, PREFIX_LOOKUPS * k),
            _row("vllm-a", "prefix_cache_hits_total", labels, k, PREFIX_HITS * k),
        ]
        observed = TTFT_PER_SCRAPE[engine]
        for bound in TTFT_BOUNDS:
            cumulative = sum(v <= bound for v in observed) * k
            rows.append(_row("vllm-a", "ttft_seconds_bucket", {**labels, "le": _le(bound)}, k, cumulative))
        rows.append(_row("vllm-a", "ttft_seconds_count", labels, k, len(observed) * k))
        rows.append(_row("vllm-a", "ttft_seconds_sum", labels, k, sum(observed) * k))
    return [{**r, "target_id": target_id} for r in rows]


def _dcgm(k: int, target_id: int) -> list[dict[str, Any]]:
    rows = []
    for gpu, fraction in GPU_MEMORY.items():
        labels = {"gpu": gpu, "UUID": f"GPU-0000000{gpu}", "Hostname": NODE, "node": NODE}
        rows += [
            _row("dcgm-node1", "utilization", labels, k, GPU_UTILIZATION[gpu]),
            _row("dcgm-node1", "memory_used_bytes", labels, k, fraction * GPU_TOTAL_BYTES),
            _row("dcgm-node1", "memory_total_bytes", labels, k, GPU_TOTAL_BYTES),
            _row("dcgm-node1", "gpu_power_watts", labels, k, 500.0 if gpu == "0" else 200.0),
            _row("dcgm-node1", "gpu_temperature_celsius", labels, k, 70.0 if gpu == "0" else 50.0),
        ]
    return [{**r, "target_id": target_id} for r in rows]


def scraped_points(vllm_target: int, dcgm_target: int) -> list[dict[str, Any]]:
    """`series_points` rows of both scraped instances, every scrape."""
    return [row for k in range(SCRAPES) for row in (*_vllm(k, vllm_target), *_dcgm(k, dcgm_target))]


def ttft_buckets() -> list[tuple[float, float]]:
    """The merged (both engines) TTFT bucket increase over the seeded scrapes: (upper bound, cumulative)."""
    observed = [v for values in TTFT_PER_SCRAPE.values() for v in values]
    return [(b, float(sum(v <= b for v in observed) * (SCRAPES - 1))) for b in TTFT_BOUNDS]
