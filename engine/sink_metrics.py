"""The HTTP sink's counters on a prometheus registry (the engine's /metrics), read from the sink itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from engine.http_sink import HttpSink


class SinkMetrics:
    """Exposes the sink's plain counters to a prometheus registry (no double bookkeeping)."""

    def __init__(self, sink: HttpSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.sink
        yield CounterMetricFamily("kvpilot_telemetry_events_sent", "events acknowledged by the collector", s.sent)
        yield CounterMetricFamily("kvpilot_telemetry_events_spooled", "events written to the spool", s.spooled)
        dropped = CounterMetricFamily(
            "kvpilot_telemetry_events_dropped", "events lost before the collector stored them", labels=["reason"]
        )
        for reason, n in s.dropped_by_reason().items():
            dropped.add_metric([reason], n)
        yield dropped
        yield CounterMetricFamily("kvpilot_telemetry_send_retries", "batch sends that were retries", s.retries)
        yield CounterMetricFamily(
            "kvpilot_telemetry_auth_failures", "sends the collector refused with 401/403", s.auth_failures
        )
        yield GaugeMetricFamily(
            "kvpilot_telemetry_unauthorized", "1 while sending is stopped: the collector refused the token", s.stopped
        )
        yield CounterMetricFamily("kvpilot_telemetry_gap_records_sent", "gap records the collector stored", s.gaps_sent)
        yield GaugeMetricFamily("kvpilot_telemetry_queue_events", "events waiting in memory", s.queued)
        yield GaugeMetricFamily("kvpilot_telemetry_spool_bytes", "bytes waiting in the spool", s.spool_bytes)
