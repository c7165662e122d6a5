"""`kvpilot bench alerts`: notification latency and rule evaluation throughput.

Latency: from the moment a rule's condition has held for its `for` to the webhook's receipt at a local
receiver, through the real path (evaluator -> SQLite state + outbox -> delivery worker -> HTTP). The
evaluator runs with interval 100 ms and group_wait 0; each trial is a new instance (its own group), so
every trial is one fresh notification. Throughput: the built-in rules over 100 instances with an hour of
10 s samples (a day for the TTFT baseline), `series_evaluated_per_s` = label sets examined by rule
evaluations per second; `series_evaluated_per_s_1000`: the same at 1,000 label sets per series name
(250 instances x 4 GPUs, each with `gpu` and `node` labels). SQL TTFT: TTFTRegression through `SqlSource`
over a day of stored requests (4 instances, SQLite): the first evaluation reads the whole day, later ones
only the unsettled minutes. Two evaluators: two `kvpilot alerts run`s (`start_evaluator`, each its own
engine and thread) on one SQLite database with a 2 s lease, a receiver that takes 0.25 s per POST and
16 alerts in 16 groups firing at once; `two_evaluators_duplicate_posts` counts POSTs the receiver got
for an Idempotency-Key it already had (what a receiver without dedup would show as a second page).
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

from alerts.config import webhook_config
from alerts.expr_ast import selectors
from alerts.expr_eval import CachingSource, Evaluator
from alerts.memory_source import MemorySource
from alerts.rules import BUILTIN_RULES, load_rule_files, load_rules_text
from alerts.runner import AlertEvaluator, start_evaluator
from alerts.sink import run_webhook_sink
from alerts.sql_source import SqlSource
from collector.db import make_engine, session_factory, upgrade
from collector.ingest import parse_batch, store_batch
from collector.schema import AlertNotification
from plumbing.percentile import nearest_rank

LATENCY_RULES = """
groups:
  - name: bench
    interval: 100ms
    rules:
      - alert: BenchQueueHigh
        expr: queue_depth > 100
        for: 1s
        labels: {severity: page}
"""


def _latency(trials: int) -> dict:
    groups = load_rules_text(LATENCY_RULES)
    hold_s = groups[0].rules[0].for_s
    source = MemorySource()
    sink = run_webhook_sink(port=0, secret="bench", log_payloads=False)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'alerts-bench.db'}"
        upgrade(url)
        engine = make_engine(url)
        config = webhook_config(
            [sink.url], secret="bench", group_wait_s=0.0, group_interval_s=1.0, group_by=["alertname", "instance"]
        )
        evaluator = AlertEvaluator(session_factory(engine), groups, source, config)
        stop = threading.Event()
        start = time.time() + 0.5
        onsets = {f"inst-{i}": start + i * 0.3 for i in range(trials)}

        def feed() -> None:
            while not stop.is_set():
                now = time.time()
                for instance, onset in onsets.items():
                    source.add("queue_depth", instance, now, 500.0 if now >= onset else 0.0)
                stop.wait(0.02)

        def loop() -> None:
            while not stop.is_set():
                evaluator.tick()
                stop.wait(0.02)

        threads = [threading.Thread(target=feed, daemon=True), threading.Thread(target=loop, daemon=True)]
        for t in threads:
            t.start()
        ok = sink.wait_for(trials, timeout_s=(start - time.time()) + trials * 0.3 + hold_s + 15)
        stop.set()
        for t in threads:
            t.join(5)
        evaluator.step_down()
        if evaluator.delivery is not None:
            evaluator.delivery.close()
        engine.dispose()
    sink.stop()
    latencies = []
    for received in sink.received:
        for alert in received.payload["alerts"]:
            instance = alert["labels"]["instance"]
            latencies.append(received.at - (onsets[instance] + hold_s))
    if not ok or not latencies:
        raise RuntimeError(f"only {len(sink.received)}/{trials} notifications arrived")
    return {
        "trials": trials,
        "delivered": len(latencies),
        "duplicates": sink.duplicates,
        "delivery_p50_s": round(nearest_rank(latencies, 0.5), 4),
        "delivery_p99_s": round(nearest_rank(latencies, 0.99), 4),
        "delivery_max_s": round(max(latencies), 4),
        "eval_interval_s": groups[0].interval_s,
        "for_s": hold_s,
    }


def _two_evaluators(alerts: int, delay_s: float, lease_ttl_s: float = 2.0) -> dict:
    from sqlalchemy import select

    source = MemorySource()
    instances = [f"inst-{i:02d}" for i in range(alerts)]
    sink = run_webhook_sink(port=0, log_payloads=False)
    sink.delay_s = delay_s
    config = webhook_config([sink.url], group_wait_s=0.0, group_interval_s=1.0, group_by=["alertname", "instance"])
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            for instance in instances:
                source.add("queue_depth", instance, time.time(), 500.0)
            stop.wait(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'alerts-ha.db'}"
        upgrade(url)
        rules = Path(tmp) / "rules.yml"
        rules.write_text(LATENCY_RULES.replace("for: 1s", "for: 0s"))
        watch = make_engine(url)
        started = time.time()
        handles = [
            start_evaluator(
                url, rule_files=[rules], source=source, notifier=config, poll_s=0.05, lease_ttl_s=lease_ttl_s
            )
            for _ in range(2)
        ]
        try:
            deadline = time.monotonic() + 60
            statuses: list[str] = []
            while time.monotonic() < deadline:
                with watch.connect() as conn:
                    statuses = list(conn.execute(select(AlertNotification.status)).scalars())
                if len(statuses) >= alerts and set(statuses) == {"delivered"}:
                    break
                time.sleep(0.1)
            took = time.time() - started
        finally:
            stop.set()
            for handle in handles:
                handle.stop()
            watch.dispose()
    sink.stop()
    return {
        "two_evaluators_alerts": alerts,
        "two_evaluators_receiver_delay_s": delay_s,
        "two_evaluators_lease_ttl_s": lease_ttl_s,
        "two_evaluators_notifications": len(statuses),
        "two_evaluators_posts": len(sink.received) + sink.duplicates,
        "two_evaluators_duplicate_posts": sink.duplicates,
        "two_evaluators_all_delivered_s": round(took, 2),
    }


def _throughput(instances: int, rounds: int, gpus: int = 0) -> dict:
    """Every series of every rule per label set: one per instance, or `gpus` per instance (labels gpu and
    node, so SchedulerBlocked's node join runs too). `series_evaluated` counts label sets per rule."""
    groups = load_rule_files([BUILTIN_RULES])
    rules = [r for g in groups for r in g.rules]
    names = {s.name for r in rules for s in selectors(r.expr)}
    source = MemorySource()
    now = 1_800_000_000.0
    for i in range(instances):
        instance = f"engine-{i}"
        label_sets = [{"gpu": str(g), "node": f"node-{i}"} for g in range(gpus)] if gpus else [{}]
        for name in names:
            for g, labels in enumerate(label_sets):
                if name == "ttft_p99_seconds":
                    points = [(now - 86400 - 900 + k * 60.0, 0.1 + 0.001 * ((k + g) % 7)) for k in range(1456)]
                else:
                    counter = name.endswith("_total")
                    points = [
                        (now - 3600 + k * 10.0, float(k) if counter else 0.5 + 0.01 * ((k + i + g) % 50))
                        for k in range(361)
                    ]
                source.add_many(name, instance, points, labels)
    series = instances * max(gpus, 1)
    evaluated = 0
    started = time.perf_counter()
    for r in range(rounds):
        ts = now - (rounds - r) * 15.0
        evaluator = Evaluator(CachingSource(source))
        for rule in rules:
            evaluator.evaluate(rule.expr, ts)
            evaluated += series
    elapsed = time.perf_counter() - started
    return {
        "instances": instances,
        "series_per_name": series,
        "rules": len(rules),
        "rounds": rounds,
        "series_evaluated": evaluated,
        "series_evaluated_per_s": round(evaluated / elapsed, 1),
        "round_s": round(elapsed / rounds, 4),
    }


def _sql_ttft(requests_per_s: float, ticks: int = 5) -> dict:
    import json
    import random

    rule = next(r for g in load_rule_files([BUILTIN_RULES]) for r in g.rules if r.name == "TTFTRegression")
    now = 1_800_000_000.0
    rng = random.Random(5)
    per_instance = int(86400 * requests_per_s)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'alerts-sql-bench.db'}"
        upgrade(url)
        engine = make_engine(url, sqlite_synchronous="NORMAL")
        for instance in ("e0", "e1", "e2", "e3"):
            for lo in range(0, per_instance, 20_000):
                events = [
                    {
                        "type": "request",
                        "v": 1,
                        "instance": instance,
                        "run_id": "r",
                        "request_id": f"{k}",
                        "ts": now - 86400 - 900 + k / requests_per_s,
                        "status": "finished",
                        "prompt_tokens": 1,
                        "output_tokens": 1,
                        "queue_s": 0,
                        "prefill_s": 0,
                        "ttft_s": rng.uniform(0.05, 0.3),
                        "decode_s": 0,
                        "e2e_s": 0.5,
                    }
                    for k in range(lo, min(lo + 20_000, per_instance))
                ]
                body = json.dumps({"events": events}).encode()
                store_batch(engine, parse_batch(body, max_events=len(events)), idempotency_key=None, content=body)
        clock = [now]
        source = SqlSource(engine, clock=lambda: clock[0])
        times = []
        for _ in range(ticks):
            started = time.perf_counter()
            Evaluator(CachingSource(source)).evaluate(rule.expr, clock[0])
            times.append(time.perf_counter() - started)
            clock[0] += 15.0
        engine.dispose()
    return {
        "sql_ttft_rows": 4 * per_instance,
        "sql_ttft_first_eval_s": round(times[0], 3),
        "sql_ttft_next_eval_p50_s": round(nearest_rank(times[1:], 0.5), 4),
    }


def run_alerts_bench(quick: bool) -> dict:
    print("alerts bench: latency (real evaluator + SQLite outbox + HTTP receiver)...", file=sys.stderr)
    latency = _latency(trials=10 if quick else 40)
    print("alerts bench: evaluation throughput...", file=sys.stderr)
    throughput = _throughput(instances=100, rounds=3 if quick else 10)
    print("alerts bench: evaluation throughput at 1,000 series (250 instances x 4 GPUs)...", file=sys.stderr)
    wide = _throughput(instances=250, gpus=4, rounds=2 if quick else 5)
    print("alerts bench: TTFTRegression over a day of stored requests (SqlSource, SQLite)...", file=sys.stderr)
    sql_ttft = _sql_ttft(requests_per_s=0.1 if quick else 1.0)
    print("alerts bench: two evaluators on one database, a slow receiver (0.25 s per POST)...", file=sys.stderr)
    two = _two_evaluators(alerts=16, delay_s=0.25)
    return {
        "benchmark": "alerts",
        "quick": quick,
        **latency,
        **throughput,
        "series_evaluated_per_s_1000": wide["series_evaluated_per_s"],
        "round_s_1000": wide["round_s"],
        **sql_ttft,
        **two,
        "target_delivery_p99_s": 1.0,
        "meets_target": latency["delivery_p99_s"] <= 1.0 and two["two_evaluators_duplicate_posts"] == 0,
    }
