"""The built-in rules over real collector data: events stored by collector.ingest, read by alerts.sql_source.

On SQLite and PostgreSQL. The evaluator's clock is injected and the seeded events carry its times, so
every transition happens at a known tick and every value equals what was seeded.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest
from sqlalchemy import insert

from alerts.memory_source import MemorySource
from alerts.metrics import AlertMetrics
from alerts.rules import BUILTIN_RULES, load_rule_files
from alerts.runner import AlertEvaluator
from alerts.sql_source import SqlSource
from collector.db import session_factory
from collector.ingest import parse_batch, store_batch
from collector.schema import SeriesPoint
from plumbing.percentile import nearest_rank
from tests.alerts.conftest import FakeClock
from tests.collector import evfactory

T = 1_760_000_040.0  # a whole minute (evfactory's T0 is not)
GIB = 2**30


def _ingest(engine, events: list[dict]) -> None:
    for i in range(0, len(events), 5000):
        body = json.dumps({"events": events[i : i + 5000]}).encode()
        store_batch(engine, parse_batch(body, max_events=10_000), idempotency_key=None, content=body)


def _at(factory, ts: float, **kw) -> dict:
    event = factory(0, **kw)
    event["ts"] = ts
    return event


def _alert(ev: AlertEvaluator, rule: str, instance: str = "e0"):
    state = next(s for s in ev.states.values() if s.rule.name == rule)
    return next((a for a in state.active.values() if a.labels.get("instance") == instance), None)


def _active_rules(ev: AlertEvaluator) -> set[str]:
    return {s.rule.name for s in ev.states.values() if s.active}


def test_memory_pressure_pending_firing_resolved_on_stored_samples(db_engine, config_for, sink):
    events = []
    for k in range(41):  # every 15 s for 10 minutes; e0 at 15/16 of memory for 7 minutes, then 1/4
        ts = T + 15.0 * k
        used = 15 * GIB if k < 28 else 4 * GIB
        events.append(_at(evfactory.sample, ts, memory_used_bytes=used, memory_total_bytes=16 * GIB))
        events.append(_at(evfactory.sample, ts, instance="e1", memory_used_bytes=4 * GIB, memory_total_bytes=16 * GIB))
        events.append(_at(evfactory.step, ts, step=k))
        events.append(_at(evfactory.request, ts, request_id=f"q{k}", ttft_s=0.05))
    _ingest(db_engine, events)
    clock = FakeClock(T)
    source = SqlSource(db_engine, clock=clock)
    ev = AlertEvaluator(
        session_factory(db_engine),
        load_rule_files([BUILTIN_RULES]),
        source,
        config_for(sink),
        clock=clock,
        metrics=AlertMetrics(),
    )
    seen = []
    try:
        for k in range(41):
            clock.now = T + 15.0 * k
            assert ev.tick().error is None
            alert = _alert(ev, "MemoryPressure")
            seen.append(None if alert is None else alert.state)
            if k == 0:
                assert alert.value == 15 / 16 and alert.active_at == T
                assert alert.annotations["summary"] == "e0: accelerator memory at 93.75%"
                assert alert.labels == {"alertname": "MemoryPressure", "instance": "e0", "severity": "page"}
            assert _alert(ev, "MemoryPressure", "e1") is None
            assert _active_rules(ev) <= {"MemoryPressure"}, _active_rules(ev)
    finally:
        if ev.delivery is not None:
            ev.delivery.close()
    # for: 5m -> firing at the tick 300 s after active_at (k = 20); the sample at k = 28 is 0.25
    assert seen == ["pending"] * 20 + ["firing"] * 8 + ["inactive"] * 13
    assert sink.wait_for(2, 5)
    firing, resolved = (r.payload for r in sink.received[:2])
    assert firing["status"] == "firing" and resolved["status"] == "resolved"
    assert firing["alerts"][0]["annotations"]["summary"] == "e0: accelerator memory at 93.75%"
    assert firing["alerts"][0]["startsAt"] == "2025-10-09T08:59:00Z"  # T + 300, fired_at
    assert resolved["alerts"][0]["endsAt"] == "2025-10-09T09:01:00Z"  # T + 420


def _requests(instance: str, minute_end: float, ttfts: list[float], **kw) -> list[dict]:
    step = 60.0 / (len(ttfts) + 1)
    return [
        _at(
            evfactory.request,
            minute_end - 60.0 + step * (i + 1),
            instance=instance,
            request_id=f"{instance}-{minute_end}-{i}",
            ttft_s=v,
            **kw,
        )
        for i, v in enumerate(ttfts)
    ]


def test_ttft_p99_per_minute_equals_nearest_rank_and_memo_follows_new_data(db_engine):
    rng = random.Random(3)
    expected: dict[str, dict[float, float]] = defaultdict(dict)
    events = []
    for minute in range(1, 31):
        end = T + 60.0 * minute
        for instance, n in (("e0", 1 + minute * 7), ("e1", 3)):
            values = [round(rng.uniform(0.01, 2.0), 4) for _ in range(n)]
            events += _requests(instance, end, values)
            expected[instance][end] = nearest_rank(values, 0.99)
        events += _requests("e0", end, [99.0], warmup=True)  # warmup requests do not count
        events += _requests("e0", end, [None], status="failed")  # nor requests without a first token
    _ingest(db_engine, events)
    clock = FakeClock(T + 3600)  # everything older than 15 minutes is settled
    source = SqlSource(db_engine, clock=clock)
    got = source.points("ttft_p99_seconds", T, T + 1800)
    assert got == {((("instance", inst),)): sorted(by_end.items()) for inst, by_end in expected.items()}
    assert source.points("ttft_p99_seconds", T + 600, T + 1200, ["e1"]) == {
        (("instance", "e1"),): sorted((e, v) for e, v in expected["e1"].items() if T + 600 <= e <= T + 1200)
    }
    queries = source.p99_queries
    source.points("ttft_p99_seconds", T, T + 1800)
    assert source.p99_queries == queries  # settled minutes come from the memo
    # the evaluator's clock moves on: only the new, unsettled minutes are read again
    clock.now = T + 1800 + 60
    late = _requests("e1", T + 1860, [5.0])
    _ingest(db_engine, late)
    got = source.points("ttft_p99_seconds", T + 1500, T + 1860)
    assert got[(("instance", "e1"),)][-1] == (T + 1860, 5.0)
    assert got[(("instance", "e0"),)] == sorted((e, v) for e, v in expected["e0"].items() if e >= T + 1500)


def test_ttft_regression_fires_over_a_day_of_stored_requests(db_engine, config_for, sink):
    """TTFTRegression: p99 over 1.5x its trailing-day median (offset 10m) and over 0.2 s, for 10m."""
    day = 86400.0
    start = T - day - 1800
    events = []
    minutes = int((day + 1800) / 60)
    for m in range(1, minutes + 1):
        events += _requests("e0", start + 60.0 * m, [0.1, 0.15, 0.2])  # p99 0.2 all day
    spike_from = T
    for m in range(1, 16):
        events += _requests("e0", spike_from + 60.0 * m, [0.3, 0.5, 0.4])  # p99 0.5 for 15 minutes
    _ingest(db_engine, events)
    clock = FakeClock(spike_from + 60)
    source = SqlSource(db_engine, clock=clock)
    ev = AlertEvaluator(
        session_factory(db_engine),
        load_rule_files([BUILTIN_RULES]),
        source,
        config_for(sink),
        clock=clock,
        metrics=AlertMetrics(),
        deliver=False,
    )
    states = []
    for m in range(1, 16):
        clock.now = spike_from + 60.0 * m
        assert ev.tick().error is None
        alert = _alert(ev, "TTFTRegression")
        states.append(None if alert is None else (alert.state, alert.value))
    assert states[0] == ("pending", 0.5)
    assert [s[0] for s in states] == ["pending"] * 10 + ["firing"] * 5  # for: 10m
    assert all(s[1] == 0.5 for s in states)
    assert _active_rules(ev) == {"TTFTRegression"}
    # the day-long range was read once; later ticks read only minutes not settled or not memoised yet
    assert source.p99_queries <= 3 * 15  # per tick: the memo grows by a minute, plus two recent windows


@pytest.mark.parametrize(
    "name", ["memory_usage", "queue_depth", "kv_usage", "kv_fragmentation", "utilization", "kv_blocks_used"]
)
def test_sql_source_agrees_with_memory_source(db_engine, name):
    """The same samples through the collector's tables and through MemorySource give the same points."""
    columns = {
        "queue_depth": "queue_depth",
        "kv_usage": "kv_usage",
        "kv_fragmentation": "fragmentation",
        "utilization": "utilization",
    }
    memory = MemorySource()
    events = []
    for k in range(20):
        ts = T + 10.0 * k
        value = float(k) if name == "queue_depth" else round(0.05 * k, 2)
        if name == "memory_usage":
            events.append(_at(evfactory.sample, ts, memory_used_bytes=k * GIB, memory_total_bytes=20 * GIB))
            memory.add(name, "e0", ts, k / 20)
        elif name == "kv_blocks_used":
            events.append(_at(evfactory.step, ts, step=k, kv_blocks_used=k))
            memory.add(name, "e0", ts, float(k))
        else:
            events.append(_at(evfactory.sample, ts, **{columns[name]: int(value) if name == "queue_depth" else value}))
            memory.add(name, "e0", ts, value)
    _ingest(db_engine, events)
    sql = SqlSource(db_engine)
    assert sql.points(name, T + 30, T + 120) == memory.points(name, T + 30, T + 120)  # closed at both ends
    # an instant selector's read: each series' newest sample of the window, closed at its end too
    assert sql.latest(name, T + 30, T + 120) == {
        (("instance", "e0"),): memory.points(name, T + 30, T + 120)[(("instance", "e0"),)][-1]
    }


def test_latest_is_each_series_newest_sample_pushed_or_scraped(db_engine):
    """`latest` (what instant selectors read) against the newest of `points`: engines that pushed samples,
    one whose newest sample has no value for the gauge, scraped series with labels, an instance filter, and
    instances not seen in the window."""
    events = []
    for k in range(30):
        ts = T + 2.0 * k
        events.append(_at(evfactory.sample, ts, instance="e0", queue_depth=k))
        events.append(_at(evfactory.sample, ts, instance="e1", queue_depth=100 - k, kv_usage=0.5))
        if k < 10:
            events.append(_at(evfactory.sample, ts, instance="e2", queue_depth=7))
    events.append(_at(evfactory.sample, T + 59.5, instance="e1", queue_depth=None, kv_usage=0.9))  # no queue in it
    events.append(_at(evfactory.sample, T - 3600, instance="old", queue_depth=3))  # not seen in the window
    _ingest(db_engine, events)
    with db_engine.begin() as conn:
        for k, model in enumerate(("a", "b")):
            conn.execute(
                insert(SeriesPoint),
                [
                    {
                        "name": "queue_depth",
                        "instance": "vllm-0",
                        "labels": f'{{"model":"{model}"}}',
                        "ts": T + 15.0 * j + k,
                        "value": 10.0 * j + k,
                    }
                    for j in range(4)
                ],
            )
    sql = SqlSource(db_engine)
    for start, end, instances in ((T, T + 60, None), (T + 1, T + 30, None), (T, T + 60, ["e1", "vllm-0"])):
        every = sql.points("queue_depth", start, end, instances)
        newest = {labels: pts[-1] for labels, pts in every.items() if pts}
        assert sql.latest("queue_depth", start, end, instances) == newest
    got = sql.latest("queue_depth", T, T + 60)
    assert got[(("instance", "e1"),)] == (T + 58.0, 71.0)  # its last sample carried no queue depth
    assert got[(("instance", "e2"),)] == (T + 18.0, 7.0)
    assert got[(("instance", "vllm-0"), ("model", "b"))] == (T + 46.0, 31.0)
    assert (("instance", "old"),) not in got
    assert sql.latest("kv_usage", T, T + 60) == {
        (("instance", "e0"),): (T + 58.0, 0.4),
        (("instance", "e1"),): (T + 59.5, 0.9),
        (("instance", "e2"),): (T + 18.0, 0.4),
    }
    with pytest.raises(ValueError, match="unknown series"):
        sql.latest("no_such_series", T, T + 60)


def test_the_tuners_replays_never_reach_the_rules(db_engine):
    """Simulated telemetry (instance tuner-sim) is stored beside real traffic with current timestamps."""
    events = [_at(evfactory.sample, T + 15.0 * k, instance="tuner-sim", kv_usage=1.0) for k in range(4)]
    events += [_at(evfactory.sample, T + 15.0 * k, instance="e0", kv_usage=0.5) for k in range(4)]
    events += [_at(evfactory.request, T + 10.0, instance="tuner-sim", request_id="sim-1", ttft_s=9.0)]
    _ingest(db_engine, events)
    source = SqlSource(db_engine, clock=FakeClock(T + 120))
    assert set(source.points("kv_usage", T, T + 60)) == {(("instance", "e0"),)}
    assert source.points("ttft_p99_seconds", T, T + 120) == {}
