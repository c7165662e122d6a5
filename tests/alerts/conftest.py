"""Alerts fixtures: an injected clock, a local webhook receiver, an evaluator factory on the shared DB fixtures."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from alerts.config import NotifierConfig, webhook_config
from alerts.delivery import DeliveryWorker
from alerts.memory_source import MemorySource
from alerts.metrics import AlertMetrics
from alerts.rules import RuleGroup, load_rules_text
from alerts.runner import AlertEvaluator
from alerts.sink import WebhookSink, run_webhook_sink
from collector.db import make_engine, session_factory

T0 = 1_800_000_000.0


class FakeClock:
    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sink() -> Iterator[WebhookSink]:
    s = run_webhook_sink(port=0, secret="s3cret", log_payloads=False)
    yield s
    s.stop()


RULES = """
groups:
  - name: test
    interval: 10s
    rules:
      - alert: QueueHigh
        expr: queue_depth > 100
        for: 30s
        labels: {severity: page}
        annotations: {summary: "{{ $labels.instance }} queue {{ $value }}"}
"""


@pytest.fixture
def groups() -> list[RuleGroup]:
    return load_rules_text(RULES)


@pytest.fixture
def make_evaluator(db_url: str, clock: FakeClock) -> Iterator[Callable[..., AlertEvaluator]]:
    engines = []
    made: list[AlertEvaluator] = []

    def make(
        source: MemorySource, groups: list[RuleGroup], config: NotifierConfig, *, holder: str = "a", **kwargs: object
    ) -> AlertEvaluator:
        engine = make_engine(db_url)
        engines.append(engine)
        factory = session_factory(engine)
        metrics = AlertMetrics()
        delivery_kwargs = {k: kwargs.pop(k) for k in ("base_backoff_s", "max_backoff_s", "max_age_s") if k in kwargs}
        delivery = DeliveryWorker(
            factory,
            {r.name: r for r in config.receivers},
            clock=clock,
            metrics=metrics,
            rng=random.Random(7),
            **delivery_kwargs,
        )
        ev = AlertEvaluator(
            factory, groups, source, config, clock=clock, holder=holder, metrics=metrics, delivery=delivery, **kwargs
        )
        made.append(ev)
        return ev

    yield make
    for ev in made:
        if ev.delivery is not None:
            ev.delivery.close()
    for engine in engines:
        engine.dispose()


def _config_for(sink: WebhookSink, **kwargs: object) -> NotifierConfig:
    defaults: dict = {"secret": "s3cret", "group_wait_s": 0.0, "group_interval_s": 10.0, "repeat_interval_s": 3600.0}
    defaults.update(kwargs)
    return webhook_config([sink.url], **defaults)


@pytest.fixture
def config_for() -> Callable[..., NotifierConfig]:
    return _config_for
