"""A deterministic seeded database for the dashboard tests: events through the collector's ingest path,
alert state, deliveries and silences as the alerts package stores them, scrape targets, proposals and an
Optuna study. `Seed` keeps the raw values so tests compute the expected numbers independently.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert

from collector.db import make_engine, session_factory, session_scope
from collector.ingest import parse_batch, store_batch
from collector.schema import (
    AlertNotification,
    AlertNotificationAttempt,
    AlertSilence,
    AlertState,
    Proposal,
    ScrapeTarget,
    SeriesPoint,
)
from tests.collector import evfactory as ev
from tests.dashboard.seed_scraped import NODE, scraped_points

T0 = ev.T0
SPAN_S = 600.0
NOW_OFFSET_S = 1000.0  # alert and target times: T0 + this


@dataclass
class Seed:
    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    allocs: list[dict[str, Any]] = field(default_factory=list)
    study_name: str = "kv-tune"

    def finished(self, instance: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["status"] == "finished" and instance in (None, r["instance"])]


def _requests() -> list[dict[str, Any]]:
    out = []
    for inst, n, base in (("e0", 60, 0.0), ("e1", 40, 0.02)):
        for i in range(n):
            queue = 0.002 * (i % 5) + base
            prefill = 0.005 + 0.001 * (i % 3)
            decode = 0.1 + 0.01 * (i % 7)
            ttft = queue + prefill + 0.001
            status = "failed" if inst == "e0" and i in (13, 47) else "finished"
            swapped = i % 10 == 0
            # Swap time, inside decode; requests never swapped send no swap_s (as engines before it did).
            swap = {"swap_s": round(0.02 + 0.01 * (i % 4), 4)} if swapped else {}
            out.append(
                ev.request(
                    0,
                    instance=inst,
                    run_id="r1",
                    ts=T0 + 10.0 * i + (3.0 if inst == "e1" else 0.0),
                    request_id=f"{inst}-q{i}",
                    status=status,
                    prompt_tokens=100 + i,
                    output_tokens=11,
                    queue_s=queue,
                    prefill_s=prefill,
                    ttft_s=ttft,
                    decode_s=decode,
                    e2e_s=ttft + decode,
                    swaps=1 if swapped else 0,
                    preemptions=1 if i % 20 == 0 else 0,
                    **swap,
                )
            )
    # The slowest request of the window, by far: e0 at T0 + 305.
    out.append(
        ev.request(
            0,
            instance="e0",
            run_id="r1",
            ts=T0 + 305.0,
            request_id="e0-slow",
            queue_s=1.5,
            prefill_s=0.2,
            ttft_s=1.71,
            decode_s=2.0,
            e2e_s=3.71,
            output_tokens=51,
        )
    )
    return out


def _samples() -> list[dict[str, Any]]:
    out = []
    for inst in ("e0", "e1"):
        for k in range(60):
            out.append(
                ev.sample(
                    0,
                    instance=inst,
                    run_id="r1",
                    ts=T0 + 10.0 * k + 1.0,
                    utilization=0.6 if inst == "e0" else 0.3,
                    kv_usage=round(0.3 + 0.005 * k, 4) if inst == "e0" else 0.2,
                    cold_usage=0.05,
                    fragmentation=0.1,
                    internal_waste=0.04,
                    queue_depth=k % 4,
                    running=8,
                    swap_rate=0.5,
                    prefix_hit_rate=0.25,
                )
            )
    return out


def _steps() -> list[dict[str, Any]]:
    return [
        ev.step(k, instance=inst, run_id="r1", ts=T0 + 5.0 * k + 2.0, prefill_tokens=64, decode_tokens=8)
        for inst in ("e0", "e1")
        for k in range(120)
    ]


OPS = ("alloc", "alloc", "free", "swap_out", "swap_in", "evict")


def _allocs() -> list[dict[str, Any]]:
    out = []
    for k in range(150):
        op = OPS[k % len(OPS)]
        out.append(
            ev.alloc(
                0,
                instance="e0",
                run_id="r1",
                ts=T0 + 4.0 * k + 0.5,
                op=op,
                request_id=f"e0-q{k % 60}",
                blocks=2 + k % 3,
                tier="cold" if op == "swap_out" else "hot",
                usage_after=round(0.3 + 0.002 * k, 4),
            )
        )
    return out


def _ingest(engine, events: list[dict[str, Any]]) -> None:
    for lo in range(0, len(events), 500):
        body = ev.body(events[lo : lo + 500])
        store_batch(engine, parse_batch(body, max_events=20_000), idempotency_key=None, content=body)


def _alerts(session) -> None:
    now = T0 + NOW_OFFSET_S
    session.add_all(
        [
            AlertState(
                rule="KvCacheNearlyFull",
                fingerprint="a1",
                labels={"alertname": "KvCacheNearlyFull", "instance": "e0", "severity": "warning"},
                annotations={"summary": "KV cache 95% full on e0"},
                state="firing",
                active_at=now - 300,
                fired_at=now - 240,
                resolved_at=None,
                keep_firing_since=None,
                last_value=0.95,
                last_eval_at=now,
                generator_url="",
            ),
            AlertState(
                rule="HighTTFT",
                fingerprint="a2",
                labels={"alertname": "HighTTFT", "instance": "e1", "severity": "page"},
                annotations={"summary": "TTFT p99 above SLO on e1"},
                state="pending",
                active_at=now - 30,
                fired_at=None,
                resolved_at=None,
                keep_firing_since=None,
                last_value=2.5,
                last_eval_at=now,
                generator_url="",
            ),
        ]
    )
    body = {
        "receiver": "team",
        "status": "firing",
        "version": "4",
        "alerts": [
            {
                "status": "firing",
                "labels": {"alertname": "KvCacheNearlyFull", "instance": "e0", "severity": "warning"},
                "annotations": {"summary": "KV cache 95% full on e0"},
                "startsAt": "2025-10-09T08:49:20Z",
                "endsAt": "0001-01-01T00:00:00Z",
            }
        ],
    }
    common = {
        "kind": "webhook",
        "url": "http://127.0.0.1:9/hook",
        "group_key": "{}:{}",
        "body": json.dumps(body),
        "next_attempt_at": now,
        "fencing_token": 1,
        "due_at": now,
    }
    session.add_all(
        [
            AlertNotification(
                id=1,
                idempotency_key="n1",
                receiver="team",
                status="delivered",
                attempts=2,
                created_at=T0 + 200,
                delivered_at=T0 + 205,
                **common,
            ),
            AlertNotification(
                id=2,
                idempotency_key="n2",
                receiver="pager",
                status="failed",
                attempts=3,
                created_at=T0 + 400,
                last_error="HTTP 500 from receiver",
                **common,
            ),
        ]
    )
    session.add_all(
        [
            AlertNotificationAttempt(
                notification_id=1,
                attempt=1,
                started_at=T0 + 200,
                duration_s=0.05,
                http_status=503,
                outcome="retry",
                error="HTTP 503",
            ),
            AlertNotificationAttempt(
                notification_id=1,
                attempt=2,
                started_at=T0 + 205,
                duration_s=0.04,
                http_status=200,
                outcome="delivered",
                error=None,
            ),
            *[
                AlertNotificationAttempt(
                    notification_id=2,
                    attempt=a,
                    started_at=T0 + 400 + a,
                    duration_s=0.1,
                    http_status=500,
                    outcome="retry" if a < 3 else "failed",
                    error="HTTP 500",
                )
                for a in (1, 2, 3)
            ],
        ]
    )
    session.add(
        AlertSilence(
            id="00000000-0000-4000-8000-000000000001",
            matchers=[{"name": "alertname", "value": "HighTTFT", "isRegex": False, "isEqual": True}],
            starts_at=T0,
            ends_at=T0 + 10 * 365 * 86400.0,
            created_by="oncall",
            comment="known slow e1",
            created_at=T0,
            updated_at=T0,
        )
    )


def _targets(session) -> None:
    now = T0 + NOW_OFFSET_S
    session.add_all(
        [
            ScrapeTarget(
                id=1,
                url="http://10.0.0.5:8000/metrics",
                job="vllm",
                instance="vllm-a",
                interval_s=15.0,
                enabled=True,
                up=True,
                last_error=None,
                last_scrape_at=time.time(),
                scrape_duration_s=0.012,
                created_at=T0,
            ),
            ScrapeTarget(
                id=2,
                url="http://10.0.0.6:9400/metrics",
                job="dcgm",
                instance="gpu-b",
                interval_s=15.0,
                enabled=True,
                up=False,
                last_error="connection refused",
                last_scrape_at=now,
                scrape_duration_s=0.001,
                created_at=T0,
            ),
            # A DCGM exporter with a static target label (tests/dashboard/seed_scraped.py).
            ScrapeTarget(
                id=3,
                url="http://10.0.0.7:9400/metrics",
                job="dcgm",
                instance="dcgm-node1",
                interval_s=15.0,
                enabled=True,
                labels=json.dumps({"node": NODE}, separators=(",", ":")),
                sample_limit=5000,
                up=True,
                last_error=None,
                last_scrape_at=time.time(),
                scrape_duration_s=0.004,
                created_at=T0,
            ),
        ]
    )
    session.flush()
    health = (("vllm-a", 1, 1.0, 0.012), ("gpu-b", 2, 0.0, 0.001), ("dcgm-node1", 3, 1.0, 0.004))
    session.execute(
        insert(SeriesPoint.__table__),
        [
            {"instance": inst, "name": name, "labels": "{}", "ts": T0 + 15.0 * k, "value": value, "target_id": tid}
            for k in range(20)
            for inst, tid, up, took in health
            for name, value in (("up", up), ("scrape_duration_seconds", took))
        ]
        + scraped_points(vllm_target=1, dcgm_target=3),
    )


PROPOSED_YAML = "scheduler:\n  max_num_seqs: 96\n  max_num_batched_tokens: 4096\ncache:\n  block_size: 16\n"
APPLIED_YAML = "scheduler:\n  max_num_seqs: 64\n  max_num_batched_tokens: 4096\ncache:\n  block_size: 32\n"


def _proposals(session) -> None:
    session.add_all(
        [
            Proposal(
                id=1,
                created_at=T0 - 3600,
                updated_at=T0 - 3000,
                status="applied",
                study_name="kv-tune",
                instance="e0",
                config_yaml=APPLIED_YAML,
                report_md="first tuning round",
                baseline_metrics={"ttft_p99_s": 0.2},
                best_metrics={"ttft_p99_s": 0.15},
            ),
            # As tuner.nightly records them: the trial, the parameters, confirmation re-runs on fresh seeds.
            Proposal(
                id=2,
                created_at=T0 + 700,
                updated_at=T0 + 700,
                status="pending",
                study_name="kv-tune",
                instance="e0",
                config_yaml=PROPOSED_YAML,
                report_md="## Why\nmore sequences per step",
                baseline_metrics={
                    "trial": {"ttft_p99_s": 0.15, "throughput_tok_s": 1000.0},
                    "params": {"max_num_seqs": 64, "block_size": 32},
                    "confirmation": [{"goodput_tps": 900.0}, {"goodput_tps": 1100.0}],
                },
                best_metrics={
                    "trial": {"ttft_p99_s": 0.12, "throughput_tok_s": 1250.0},
                    "params": {"max_num_seqs": 96, "block_size": 16},
                    "confirmation": {
                        "gain": 0.2,
                        "min_gain": 0.05,
                        "holds": True,
                        "runs": [{"goodput_tps": 1150.0}, {"goodput_tps": 1250.0}],
                    },
                },
            ),
        ]
    )


TRIALS = [  # (max_num_seqs, block_size, ttft_p99_s, throughput_tok_s)
    (32, 16, 0.30, 800.0),
    (64, 16, 0.20, 1100.0),
    (96, 16, 0.12, 1250.0),
    (128, 16, 0.25, 1300.0),
    (64, 32, 0.18, 1000.0),
    (96, 32, 0.14, 1150.0),
    (128, 32, 0.40, 1350.0),
    (32, 32, 0.35, 700.0),
]


def pareto_trials() -> list[int]:
    """Trial numbers no other trial beats on both objectives (minimize TTFT, maximize throughput)."""
    front = []
    for i, (_, _, t, g) in enumerate(TRIALS):
        dominated = any(t2 <= t and g2 >= g and (t2, g2) != (t, g) for _, _, t2, g2 in TRIALS)
        if not dominated:
            front.append(i)
    return front


def _study(url: str, name: str) -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution, IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from tuner.storage import open_storage

    storage = open_storage(url)  # where the tuner keeps studies for this database
    study = optuna.create_study(study_name=name, storage=storage, directions=["minimize", "maximize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["ttft_p99_s", "throughput_tok_s"])
    dists = {"max_num_seqs": IntDistribution(16, 256), "block_size": CategoricalDistribution([16, 32])}
    for seqs, block, ttft, tput in TRIALS:
        study.add_trial(
            optuna.trial.create_trial(
                params={"max_num_seqs": seqs, "block_size": block}, distributions=dists, values=[ttft, tput]
            )
        )
    storage.engine.dispose()


def seed_database(url: str, *, with_study: bool = True) -> Seed:
    """Fill a migrated, empty database (see tests/conftest.py `sqlite_url`)."""
    seed = Seed(url=url, requests=_requests(), samples=_samples(), steps=_steps(), allocs=_allocs())
    engine = make_engine(url)
    try:
        _ingest(engine, seed.requests + seed.samples + seed.steps + seed.allocs)
        with session_scope(session_factory(engine)) as session:
            _alerts(session)
            _targets(session)
            _proposals(session)
    finally:
        engine.dispose()
    if with_study:
        _study(url, seed.study_name)
    return seed
