"""Scrape the target's /metrics during a run, read through the collector's own mapping.

The exposition goes through `collector.scraper.parse_exposition` and `collector.exposition.map_samples`, the
functions the collector stores a scrape with, so every engine it knows (kvpilot, vLLM, SGLang) yields the same
canonical names: utilization, kv_usage, queue_depth, running, oom_total, preemptions_total, ... A criterion
needs one figure per target, so the label sets of one name (vLLM's per-engine series, a status label) are
combined: counts and counters are summed, ratios (utilization, KV usage) averaged. Engine steps are kvpilot's
step-duration histogram count, else the count of vLLM's `vllm:iteration_tokens_total` histogram (one
observation per iteration). kvpilot's telemetry-sink series are its own (nothing maps them) and read by name.
A target that exposes none of a criterion's inputs leaves them out, and the criterion says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import httpx

from collector.exposition import map_samples
from collector.scraper import parse_exposition
from collector.series import BY_EXTERNAL, MAPPINGS

log = logging.getLogger(__name__)

# canonical name -> our key
CANONICAL_KEYS = {
    "utilization": "utilization",
    "kv_usage": "kv_usage",
    "queue_depth": "queue_depth",
    "running": "running",
    "oom_total": "oom_total",
    "preemptions_total": "preemptions_total",
    "requests_rejected_total": "rejected_total",
    "iteration_tokens_count": "steps_total",
}
AVERAGED = frozenset({"utilization", "kv_usage"})  # ratios: the mean over label sets; the rest are summed
# kvpilot's own series that no canonical name covers: sample name -> our key (labelled samples summed)
OWN = {
    "kvpilot_step_duration_seconds_count": "steps_total",
    "kvpilot_step_duration_seconds_sum": "step_seconds_total",
    "kvpilot_telemetry_events_sent_total": "telemetry_sent",
    "kvpilot_telemetry_queue_events": "telemetry_queued",
    "kvpilot_telemetry_spool_bytes": "telemetry_spool_bytes",
    "kvpilot_telemetry_send_retries_total": "telemetry_retries",
    "kvpilot_telemetry_events_dropped_total": "telemetry_dropped",
}


@dataclass(frozen=True, slots=True)
class MetricsSample:
    t: float  # seconds since the run's start
    values: dict[str, float]
    sources: frozenset[str] = field(default_factory=frozenset)  # kvpilot, vllm, sglang, ... (collector.series)


@dataclass(frozen=True, slots=True)
class Reading:
    values: dict[str, float]
    sources: frozenset[str]


def read_metrics(text: str) -> Reading:
    """Our keys -> one value per target, and the sources whose names the exposition used."""
    samples = parse_exposition(text)
    combined: dict[str, list[float]] = {}
    for point in map_samples(samples):
        key = CANONICAL_KEYS.get(point.name)
        if key is not None:
            combined.setdefault(key, []).append(point.value)
    values = {k: (sum(v) / len(v) if k in AVERAGED else sum(v)) for k, v in combined.items()}
    own: dict[str, float] = {}
    for name, _labels, value in samples:
        if (key := OWN.get(name)) is not None:
            own[key] = own.get(key, 0.0) + value
    values.update(own)  # kvpilot's step count wins over a mapped one
    sources = frozenset(m.source for name, _labels, _value in samples if (m := BY_EXTERNAL.get(name)) is not None)
    return Reading(values, sources)


def parse_metrics(text: str) -> dict[str, float]:
    """Our keys -> values, one per target (see the module docstring); raises ValueError on bad input."""
    return read_metrics(text).values


def external_names(canonical: str, sources: frozenset[str]) -> list[str]:
    """The names a canonical series has in these sources' expositions (for a criterion's detail)."""
    return [m.external for m in MAPPINGS if m.canonical == canonical and m.source in sources]


async def fetch_metrics(client: httpx.AsyncClient, base_url: str, timeout_s: float = 5.0) -> Reading | None:
    try:
        resp = await client.get(base_url + "/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.debug("scrape failed: %s", exc)
        return None
    if resp.status_code != 200:
        return None
    try:
        return read_metrics(resp.text)
    except ValueError as exc:
        log.warning("unparseable /metrics from %s: %s", base_url, exc)
        return None


@dataclass
class Scraper:
    """Polls /metrics every `interval_s` until stopped; `failures` counts scrapes that got nothing."""

    client: httpx.AsyncClient
    base_url: str
    t0: float
    interval_s: float = 0.5
    samples: list[MetricsSample] = field(default_factory=list)
    failures: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def scrape_once(self) -> MetricsSample | None:
        reading = await fetch_metrics(self.client, self.base_url)
        if reading is None:
            self.failures += 1
            return None
        sample = MetricsSample(time.perf_counter() - self.t0, reading.values, reading.sources)
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.scrape_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()
