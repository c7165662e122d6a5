"""Scrape the target's /metrics during a run, so utilization and OOM criteria use the engine's own numbers.

Only kvpilot engine names are read (`kvpilot_utilization`, `kvpilot_oom_total`, ...). A target that
does not expose one of them leaves it None, and the criterion that needs it is reported as unmeasured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# sample name in the exposition -> our key
WANTED = {
    "kvpilot_utilization": "utilization",
    "kvpilot_kv_usage": "kv_usage",
    "kvpilot_queue_depth": "queue_depth",
    "kvpilot_running_seqs": "running",
    "kvpilot_oom_total": "oom_total",
    "kvpilot_preemptions_total": "preemptions_total",
    "kvpilot_rejected_total": "rejected_total",
    "kvpilot_step_duration_seconds_count": "steps_total",
    "kvpilot_step_duration_seconds_sum": "step_seconds_total",
    "kvpilot_telemetry_events_sent_total": "telemetry_sent",
    "kvpilot_telemetry_queue_events": "telemetry_queued",
    "kvpilot_telemetry_spool_bytes": "telemetry_spool_bytes",
    "kvpilot_telemetry_send_retries_total": "telemetry_retries",
}


@dataclass(frozen=True, slots=True)
class MetricsSample:
    t: float  # seconds since the run's start
    values: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """Our keys -> values (labelled samples of one name are summed, e.g. dropped{reason})."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = WANTED.get(sample.name)
            if key is None and sample.name == "kvpilot_telemetry_events_dropped_total":
                key = "telemetry_dropped"
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


async def fetch_metrics(client: httpx.AsyncClient, base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    try:
        resp = await client.get(base_url + "/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.debug("scrape failed: %s", exc)
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_metrics(resp.text)
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
        values = await fetch_metrics(self.client, self.base_url)
        if values is None:
            self.failures += 1
            return None
        sample = MetricsSample(time.perf_counter() - self.t0, values)
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.scrape_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()
