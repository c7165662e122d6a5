"""The alerts' own Prometheus metrics; every component takes the registry (fresh one per test)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class AlertMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.evaluations = Counter("kvpilot_alerts_rule_evaluations_total", "rule evaluations", ["rule"], registry=reg)
        self.evaluation_failures = Counter(
            "kvpilot_alerts_rule_evaluation_failures_total", "rule evaluations that raised", ["rule"], registry=reg
        )
        self.series_evaluated = Counter(
            "kvpilot_alerts_series_evaluated_total", "result series produced by rule evaluations", registry=reg
        )
        self.transitions = Counter("kvpilot_alerts_transitions_total", "alert state changes", ["to"], registry=reg)
        self.lease_lost = Counter("kvpilot_alerts_lease_lost_total", "writes refused: lease lost", registry=reg)
        self.lease_held = Gauge("kvpilot_alerts_lease_held", "1 while this process holds the lease", registry=reg)
        self.enqueued = Counter(
            "kvpilot_alerts_notifications_enqueued_total", "outbox rows written", ["receiver"], registry=reg
        )
        self.attempts = Counter(
            "kvpilot_alerts_delivery_attempts_total", "HTTP delivery attempts", ["receiver", "outcome"], registry=reg
        )
        self.finished = Counter(
            "kvpilot_alerts_notifications_finished_total", "notifications done", ["receiver", "status"], registry=reg
        )
        self.superseded = Counter(
            "kvpilot_alerts_notifications_superseded_total",
            "undelivered notifications dropped for a newer one of the same group (stale backlog)",
            ["receiver"],
            registry=reg,
        )
        self.delivery_latency = Histogram(
            "kvpilot_alerts_delivery_latency_seconds",
            "outbox write to 2xx from the receiver",
            registry=reg,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30, 120, 600),
        )
        self.group_duration = Histogram(
            "kvpilot_alerts_rule_group_duration_seconds",
            "one evaluation of a rule group (its rules' reads and state updates)",
            ["group"],
            registry=reg,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.iterations_missed = Counter(
            "kvpilot_alerts_rule_group_iterations_missed_total",
            "evaluations of a group skipped because the evaluator came back later than its next interval",
            ["group"],
            registry=reg,
        )
        self.storage_errors = Counter(
            "kvpilot_alerts_storage_errors_total", "ticks failed on the database", registry=reg
        )
