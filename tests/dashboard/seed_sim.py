"""Additions to the dashboard seed for what misled an on-call reader: the tuner's replays stored next to real
traffic, and a KV spike to 100% between two regular samples.

- `tuner-sim` (the tuner's simulator instance) with trial and confirmation runs as tuner/study.py and
  tuner/nightly.py name them: many fast requests, 100% utilization, and a firing alert of its own.
- `bench-1`, a pushing instance whose only run is a trial run (`<study>-t<n>-<hex>`): simulated too.
- e0 (real) reaches KV 100% at T0 + 300.2 s and is back at 30% 0.4 s later; the regular samples are every
  10 s, so every bucket average of that stretch stays far below the 90% of the MemoryPressure demo rule.
  Around it, OOM_RETRIES allocation attempts found no free block (`oom` alloc events) while every request
  but the seed's two failed ones finished.
- A resolved SwapThrashing alert on e1, next to the seed's firing and pending ones.
"""

from __future__ import annotations

from typing import Any

from collector.db import make_engine, session_factory, session_scope
from collector.ingest import parse_batch, store_batch
from collector.schema import AlertState
from tests.collector import evfactory as ev

T0 = ev.T0
SIM = "tuner-sim"
SIM_RUNS = ("kv-tune-t0-0a1b2c", "kv-tune-t1-3d4e5f-s2", "kv-tune-confirm-best-s1000-abcdef")
TRIAL_ONLY = "bench-1"
TRIAL_ONLY_RUN = "shift-t4-aaaaaa"
SPIKE_TS = T0 + 300.2
OOM_RETRIES = 7


def simulated_events() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for k, run in enumerate(SIM_RUNS):
        for i in range(100):
            ts = T0 + 50.0 + k * 150.0 + i * 1.0
            events.append(
                ev.request(
                    0,
                    instance=SIM,
                    run_id=run,
                    ts=ts,
                    request_id=f"{run}-{i}",
                    ttft_s=0.001,
                    e2e_s=0.05,
                    output_tokens=200,
                )
            )
            events.append(ev.sample(0, instance=SIM, run_id=run, ts=ts + 0.5, utilization=1.0, kv_usage=0.17))
    for i in range(10):
        events.append(ev.request(0, instance=TRIAL_ONLY, run_id=TRIAL_ONLY_RUN, ts=T0 + 20.0 + i, request_id=f"b{i}"))
    return events


def spike_events() -> list[dict[str, Any]]:
    return [
        ev.sample(0, instance="e0", run_id="r1", ts=SPIKE_TS, kv_usage=1.0, utilization=0.6),
        ev.sample(0, instance="e0", run_id="r1", ts=SPIKE_TS + 0.4, kv_usage=0.3, utilization=0.6),
        *(
            ev.alloc(0, instance="e0", run_id="r1", ts=SPIKE_TS + 0.01 * k, op="oom", usage_after=1.0)
            for k in range(OOM_RETRIES)
        ),
    ]


def _ingest(url: str, events: list[dict[str, Any]]) -> None:
    engine = make_engine(url)
    try:
        for lo in range(0, len(events), 500):
            body = ev.body(events[lo : lo + 500])
            store_batch(engine, parse_batch(body, max_events=20_000), idempotency_key=None, content=body)
        with session_scope(session_factory(engine)) as session:
            now = T0 + 1000.0
            session.add(
                AlertState(
                    rule="MemoryPressure",
                    fingerprint="sim1",
                    labels={"alertname": "MemoryPressure", "instance": SIM, "severity": "page"},
                    annotations={"summary": "tuner-sim: memory at 100%"},
                    state="firing",
                    active_at=now - 100,
                    fired_at=now - 90,
                    resolved_at=None,
                    keep_firing_since=None,
                    last_value=1.0,
                    last_eval_at=now,
                    generator_url="",
                )
            )
            session.add(
                AlertState(
                    rule="SwapThrashing",
                    fingerprint="res1",
                    labels={"alertname": "SwapThrashing", "instance": "e1", "severity": "warning"},
                    annotations={"summary": "e1: 130 KV swaps/s"},
                    state="inactive",  # alerts.state.INACTIVE: resolved, kept for a while
                    active_at=now - 600,
                    fired_at=now - 540,
                    resolved_at=now - 120,
                    keep_firing_since=None,
                    last_value=130.0,
                    last_eval_at=now - 120,
                    generator_url="",
                )
            )
    finally:
        engine.dispose()


def add_simulated_and_spike(url: str) -> list[dict[str, Any]]:
    """Store both additions in a seeded database; returns the simulated requests."""
    events = simulated_events()
    _ingest(url, events + spike_events())
    return [e for e in events if e["type"] == "request"]
