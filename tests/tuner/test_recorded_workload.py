"""The stored traffic as it came: recorded arrivals (the user's, where the stage before the engine was measured),
bursts kept, in order, bounded; and the demo's tuning replays the demo's burst, which the fitted average-rate
workload smooths away."""

from __future__ import annotations

import random
import time

import pytest

from collector.db import make_engine
from engine.events import RequestEvent
from kvpilot import demo_tune
from kvpilot.demo_alerts import INSTANCE as DEMO_INSTANCE
from kvpilot.demo_load import BurstGate, arrivals
from tuner import workloads as WL
from tuner.jobs import workload_factory
from tuner.metrics import store_events


def _request(
    i: int, arrival: float, *, instance: str = "prod-1", frontend: float | None = None, status: str = "finished"
) -> RequestEvent:
    """A request that arrived (at the HTTP layer) at `arrival` and took 1.5 s in the engine."""
    engine_arrival = arrival + (frontend or 0.0)
    return RequestEvent(
        instance=instance,
        run_id="r",
        ts=engine_arrival + 1.5,
        request_id=f"q{i}",
        status=status,
        prompt_tokens=100 + i,
        output_tokens=0 if status != "finished" else 10 + i,
        frontend_s=frontend,
        queue_s=0.2,
        prefill_s=0.1,
        ttft_s=0.3,
        decode_s=1.2,
        e2e_s=1.5,
    )


def _store(db_url: str, events: list[RequestEvent]) -> None:
    db = make_engine(db_url)
    store_events(db, events, key_prefix=f"k{random.random()}")
    db.dispose()


def test_recorded_arrivals_are_the_users_in_order_with_bursts_kept(db_url: str) -> None:
    """On SQLite and PostgreSQL alike (`collector.queries.request_arrivals`)."""
    t0 = 1_800_000_000.0
    calm = [t0 + 2.0 * k for k in range(10)]  # one every 2 s
    burst = [t0 + 7.0 + 0.05 * k for k in range(8)]  # eight within 0.4 s
    events = [_request(i, a, frontend=0.25 if i % 2 else None) for i, a in enumerate(sorted(calm + burst))]
    events.append(_request(99, t0 + 30.0, instance="tuner-vllm-sim"))  # the tuner's own replay: no user sent it
    _store(db_url, list(reversed(events)))  # stored out of order
    db = make_engine(db_url)
    recorded = WL.recorded_traffic(db, WL.WorkloadOptions(requests=100), start=t0 - 10, end=t0 + 60)
    reqs = recorded.requests
    assert [r.arrival_s for r in reqs] == pytest.approx(sorted(a - t0 for a in calm + burst), abs=1e-6)
    assert [r.prompt_tokens for r in reqs] == [100 + i for i in range(18)]  # lengths as stored, in arrival order
    assert recorded.user_arrivals == 9 and recorded.stored == 18  # the tuner's replay left out
    shape = WL.burstiness(reqs)
    assert shape["peak_1s_arrivals"] >= 8 and shape["peak_ratio"] >= 8

    # Bounded: the latest `requests` of the window, and the last `duration_s` seconds of them.
    latest = WL.recorded_traffic(db, WL.WorkloadOptions(requests=5), start=t0 - 10, end=t0 + 60).requests
    assert len(latest) == 5 and latest[0].arrival_s == 0.0 and latest[-1].arrival_s == pytest.approx(8.0)
    short = WL.recorded_traffic(db, WL.WorkloadOptions(duration_s=5.0), start=t0 - 10, end=t0 + 60).requests
    assert [r.arrival_s for r in short] == pytest.approx([0.0, 2.0, 4.0])  # arrivals at 14, 16, 18 s
    fast = WL.recorded_traffic(db, WL.WorkloadOptions(time_scale=2.0), start=t0 - 10, end=t0 + 60).requests
    assert fast[-1].arrival_s == pytest.approx(9.0)
    db.dispose()


def test_the_stored_workload_of_an_instance_and_its_errors(sqlite_url: str) -> None:
    now = time.time()
    _store(sqlite_url, [_request(i, now - 100 + i) for i in range(5)] + [_request(9, now - 50, status="rejected")])
    db = make_engine(sqlite_url)
    factory, desc = workload_factory("stored:prod-1", WL.WorkloadOptions(hours=1.0), db=db)
    assert len(factory(0)) == 6 and factory(0) == factory(1)  # the same requests for every seed
    assert desc["kind"] == "stored" and desc["instance"] == "prod-1" and desc["unfinished"] == 1
    assert desc["lengths_filled"] == 1 and "peak_ratio" in desc
    with pytest.raises(WL.WorkloadError, match="stored:other: hours: the collector holds 0 requests of other"):
        workload_factory("stored:other", WL.WorkloadOptions(hours=1.0), db=db)
    db.dispose()


def _demo_load_rows(seed: int) -> list[RequestEvent]:
    """What the demo's engine stores for its load: `drive_demo_load`'s arrivals (2/s, a +500% burst from 7 s that
    the alert ends after 4 s), every request through the HTTP layer (`frontend_s`)."""
    clock = {"t": 0.0}
    gate = BurstGate(start_s=7.0, min_s=2.0, max_s=60.0, done=lambda: clock["t"] >= 11.0)
    start = time.time() - 120.0
    events = []
    for i, (t, shape) in enumerate(arrivals(gate, duration_s=20.0, base_rate=2.0, seed=seed, now=lambda: clock["t"])):
        clock["t"] = t
        events.append(_request(i, start + t, instance=DEMO_INSTANCE, frontend=0.002))
        events[-1] = events[-1].model_copy(update={"prompt_tokens": shape.prompt_tokens})
    return events


@pytest.mark.parametrize("seed", [7, 8])
def test_the_demo_tunes_on_the_demo_s_burst(sqlite_url: str, seed: int) -> None:
    rows = _demo_load_rows(seed)
    _store(sqlite_url, rows)
    stored_arrivals = [r.ts - r.e2e_s - (r.frontend_s or 0.0) for r in rows]
    load = WL.burstiness([WL.W.WorkloadRequest(a - min(stored_arrivals), 10, 10) for a in stored_arrivals])
    assert load["peak_ratio"] >= 3  # the demo's load had its burst
    spec, opts = demo_tune.tuning_workload(since=time.time() - 130.0, now=time.time())
    db = make_engine(sqlite_url)
    factory, desc = workload_factory(spec, opts, db=db, instances=[DEMO_INSTANCE])
    tuned = factory(0)
    assert len(tuned) == len(rows) and desc["kind"] == "stored"
    assert WL.burstiness(tuned) == load  # and so has what the demo tunes on, second for second
    fitted, _ = workload_factory("fitted", opts, db=db, instances=[DEMO_INSTANCE])
    smoothed = WL.burstiness(fitted(0))
    assert smoothed["peak_ratio"] < load["peak_ratio"] / 1.5  # the average-rate fit would have smoothed it
    db.dispose()
