"""The trap detectors (collector.queries diagnosis) on data that shows each trap and data that does not,
on SQLite and PostgreSQL alike; and "not enough data" where a source is missing, never a false "fine"."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
from sqlalchemy import Engine, insert

from collector import queries as q
from collector.exposition import labels_json
from collector.ingest import parse_batch, store_batch
from collector.schema import SeriesPoint
from tests.collector import evfactory as ev

T0 = ev.T0
NOW = T0 + 3600.0


def ingest(engine: Engine, events: list[dict[str, Any]]) -> None:
    for lo in range(0, len(events), 5000):
        raw = ev.body(events[lo : lo + 5000])
        store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=None, content=raw)


def req(arrival: float, n: int, *, queue: float = 0.005, prefill: float = 0.01, decode: float = 0.2, **kw: Any):
    e2e = queue + prefill + decode
    fields = {"request_id": f"q{n}", "queue_s": queue, "prefill_s": prefill, "ttft_s": queue + prefill + 0.001}
    return ev.request(0, ts=arrival + e2e, decode_s=decode, e2e_s=e2e, **{**fields, **kw})


def check(engine: Engine, trap: str, *, start: float = T0, end: float = T0 + 600.0, **kw: Any) -> q.Finding:
    found = q.DETECTORS[trap](engine, instance=kw.pop("instance", "e0"), start=start, end=end, now=NOW, **kw)
    assert found.trap == trap and found.title == q.TRAPS[trap].title
    assert found.knob in q.KNOBS
    return found


# --- short and long requests mixed ------------------------------------------------------------------------


def _mixed(long_prefill_s: float) -> list[dict[str, Any]]:
    """Every 2.5 s a 4000-token prompt, then four 100-token ones; the one 0.5 s after it waits for its prefill
    when that prefill takes longer than 0.5 s."""
    out = []
    for k in range(50):
        a = T0 + 1.0 + 2.5 * k
        out.append(req(a, 5 * k, prompt_tokens=4000, prefill=long_prefill_s))
        for j, dt in enumerate((0.5, 1.0, 1.5, 2.0), start=1):
            blocked = dt < long_prefill_s
            queue = long_prefill_s + 0.01 - dt + 0.005 if blocked else 0.005
            out.append(req(a + dt, 5 * k + j, prompt_tokens=100, queue=queue))
    out += [
        ev.step(0, ts=T0 + 2.5 * k + 1.5 + 0.1 * i, duration_s=0.02, prefill_tokens=0, decode_tokens=8)
        for k in range(50)
        for i in range(5)
    ]
    out += [ev.step(0, ts=T0 + 2.5 * k + 1.8, duration_s=long_prefill_s, prefill_tokens=4000) for k in range(50)]
    return out


def test_mixed_lengths_present_when_short_requests_wait_for_long_prefills(db_engine: Engine) -> None:
    ingest(db_engine, _mixed(long_prefill_s=0.8))
    f = check(db_engine, "mixed_lengths")
    assert f.present and f.severity in ("warning", "critical")
    e = f.evidence
    assert (e["prompt_tokens_p10"], e["prompt_tokens_p90"], e["spread_p90_p10"]) == (100, 4000, 40.0)
    assert e["short_behind_long"] == 50 and e["short_requests"] == 200 and e["long_requests"] == 50
    assert e["short_wait_behind_p50_s"] == pytest.approx(0.8 + 0.01 - 0.5 + 0.005 + 0.01)
    assert e["short_wait_clear_p50_s"] == pytest.approx(0.015)
    assert f.cost_value == pytest.approx(0.8 + 0.01 - 0.5 + 0.005 - 0.005)
    assert e["decode_stall_share"] > 0.5  # 50 steps of 0.8 s against 250 of 0.02 s
    assert len(f.requests) == 10 and all(r["prompt_tokens"] == 100 for r in f.requests)
    assert f.knob == "scheduler.prefill_chunk_tokens"
    args = shlex.split(f.study_command or "")
    assert args[:3] == ["kvpilot", "tune", "study"]
    assert args[args.index("--knob") + 1] == "scheduler.prefill_chunk_tokens"
    assert args[args.index("--instance") + 1] == "e0" and args[args.index("--hours") + 1] == "1"


def test_mixed_lengths_absent_when_long_prefills_block_nobody_or_sizes_are_alike(db_engine: Engine) -> None:
    ingest(db_engine, _mixed(long_prefill_s=0.3))
    f = check(db_engine, "mixed_lengths")
    assert f.status == "absent" and f.severity == "ok" and f.evidence["short_behind_long"] == 0
    alike = [req(T0 + 1.0 + 0.5 * n, n, instance="e1", prompt_tokens=100 + 2 * n) for n in range(100)]
    ingest(db_engine, alike)
    f = check(db_engine, "mixed_lengths", instance="e1")
    assert f.status == "absent" and "alike" in f.summary and f.evidence["spread_p90_p10"] < 8


def test_request_checks_say_not_enough_data_without_requests(db_engine: Engine) -> None:
    ingest(db_engine, [req(T0 + 1.0 + n, n) for n in range(10)])
    for trap in ("mixed_lengths", "bursts"):
        f = check(db_engine, trap)
        assert f.status == "no_data" and f.severity == "unknown" and not f.present
        assert "Not enough data" in f.summary and f.study_command is None


# --- bursts ---------------------------------------------------------------------------------------------


def _bursty(burst_queue_s: float) -> list[dict[str, Any]]:
    """Two arrivals a second for 100 s; 12 a second (6x) at seconds 50 and 51."""
    out = []
    for s in range(100):
        if s in (50, 51):
            out += [req(T0 + s + 0.1 + 0.05 * k, 100 * s + k, queue=burst_queue_s) for k in range(12)]
        else:
            out += [req(T0 + s + dt, 100 * s + k) for k, dt in enumerate((0.1, 0.6))]
    return out


def test_bursts_present_when_the_burst_waits(db_engine: Engine) -> None:
    ingest(db_engine, _bursty(0.2))
    f = check(db_engine, "bursts")
    assert f.present
    e = f.evidence
    assert e["baseline_arrivals_per_s"] == 2 and e["peak_arrivals_per_s"] == 12 and e["burst_seconds"] == 2
    assert e["burst_arrivals"] == 24 and e["burst_queue_p50_s"] == pytest.approx(0.2)
    assert e["other_queue_p50_s"] == pytest.approx(0.005)
    assert f.cost_value == pytest.approx(0.195)
    arrivals = dict(f.series["arrivals per second"])
    assert arrivals[T0 + 50] == 12 and arrivals[T0 + 10] == 2
    assert f.requests[0]["queue_s"] == pytest.approx(0.2)
    assert f.knob == "scheduler.max_num_batched_tokens" and "--knob scheduler.max_num_batched_tokens" in (
        f.study_command or ""
    )


def test_bursts_count_the_wait_before_the_engine_as_waiting(db_engine: Engine) -> None:
    """A vLLM's API server held the burst before its engine queued it: users waited, the queue did not show it."""
    events = _bursty(0.005)
    for e in events:
        in_burst = T0 + 50 <= e["ts"] - e["e2e_s"] < T0 + 52
        e["frontend_s"] = 0.3 if in_burst else 0.0
    ingest(db_engine, events)
    f = check(db_engine, "bursts")
    assert f.present
    assert f.evidence["burst_queue_p50_s"] == pytest.approx(0.305)
    assert f.evidence["other_queue_p50_s"] == pytest.approx(0.005)


def test_bursts_absorbed_or_absent_are_fine(db_engine: Engine) -> None:
    ingest(db_engine, _bursty(0.01))
    f = check(db_engine, "bursts")
    assert f.status == "absent" and "absorbed" in f.summary and f.evidence["burst_seconds"] == 2
    ingest(db_engine, [req(T0 + 0.1 + 0.5 * n, n, instance="e1") for n in range(200)])
    f = check(db_engine, "bursts", instance="e1")
    assert f.status == "absent" and f.evidence["burst_seconds"] == 0


def test_bursts_baseline_leaves_an_idle_gap_out(db_engine: Engine) -> None:
    """A replayed trace: 3 arrivals a second, 5 in some seconds, then 10 idle minutes, then traffic again.
    Counted in, the idle seconds make the median 0 and every 5-arrival second a "burst"; left out, the
    median is 3 and 5 is no burst."""
    out = []
    for s in [*range(60), *range(660, 720)]:
        n = 5 if s % 10 == 0 else 3
        out += [req(T0 + s + 0.1 + 0.15 * k, 10 * s + k, queue=0.08) for k in range(n)]
    ingest(db_engine, out)
    f = check(db_engine, "bursts", end=T0 + 900.0)
    e = f.evidence
    assert f.status == "absent" and e["burst_seconds"] == 0, f.summary
    assert e["baseline"] == "median" and e["baseline_arrivals_per_s"] == 3
    assert e["traffic_seconds"] == 120 and e["idle_seconds"] == 600
    assert "1.7x the median 3/s of the 120 s with traffic" in f.summary
    gap = [n for ts, n in f.series["arrivals per second"] if T0 + 100 < ts < T0 + 600]
    assert gap and max(gap) == 0  # the evidence still shows the gap


def test_findings_near_a_threshold_say_so(db_engine: Engine) -> None:
    # prompts p10 100, p90 750: 7.5, just under 8; not "alike"
    sizes = [100] * 50 + [300] * 35 + [750] * 15
    ingest(db_engine, [req(T0 + 1.0 + 0.5 * n, n, prompt_tokens=p) for n, p in enumerate(sizes)])
    f = check(db_engine, "mixed_lengths")
    assert f.status == "absent" and f.evidence["spread_p90_p10"] == pytest.approx(7.5)
    assert "alike" not in f.summary and "7.5" in f.summary and "just under the mixing threshold 8" in f.summary
    # a busiest second 3.5x the median: just under the burst threshold 4x
    out = []
    for s in range(100):
        out += [req(T0 + s + 0.05 + 0.1 * k, 100 * s + k, instance="e1") for k in range(7 if s == 50 else 2)]
    ingest(db_engine, out)
    f = check(db_engine, "bursts", instance="e1")
    assert f.status == "absent" and "3.5x the median 2/s" in f.summary
    assert "just under the burst threshold 4x" in f.summary


# --- swap thrashing -------------------------------------------------------------------------------------


def test_swap_thrashing_from_the_allocation_trace(db_engine: Engine) -> None:
    ops = ["swap_out", "swap_in"]
    events = [ev.alloc(0, ts=T0 + 100.0 + k / 150.0, op=ops[k % 2], tier="cold") for k in range(150 * 20)]
    events += [ev.alloc(0, ts=T0 + 300.0 + k, op=ops[k % 2]) for k in range(50)]  # 5/s for 10 s: not thrashing
    events += [req(T0 + 100.0 + n, n, swaps=4, swap_s=0.25) for n in range(8)] + [req(T0 + 200.0, 99)]
    ingest(db_engine, events)
    f = check(db_engine, "swap_thrashing")
    assert f.present and f.evidence["source"] == "allocation trace"
    assert f.evidence["peak_swaps_per_s"] == pytest.approx(150.0)
    assert f.evidence["seconds_above"] == 20
    assert f.evidence["swapped_requests"] == 8 and f.cost_value == pytest.approx(0.25)
    assert f.knob == "scheduler.preemption_mode"


def test_swap_thrashing_absent_from_the_gauge_and_unknown_without_a_source(db_engine: Engine) -> None:
    ingest(db_engine, [ev.sample(k, ts=T0 + k, swap_rate=2.0) for k in range(60)])
    f = check(db_engine, "swap_thrashing")
    assert f.status == "absent" and f.evidence["source"] == "swap-rate gauge"
    assert f.evidence["peak_swaps_per_s"] == pytest.approx(2.0)
    # Request rows alone (vLLM's spans: swaps always 0) cannot say there is no thrashing.
    ingest(db_engine, [req(T0 + 1.0 + n, n, instance="vllm-a") for n in range(100)])
    f = check(db_engine, "swap_thrashing", instance="vllm-a")
    assert f.status == "no_data" and not f.present


def test_swap_thrashing_from_a_scraped_counter(db_engine: Engine) -> None:
    points = [
        {
            "instance": "vllm-a",
            "name": "swaps_total",
            "labels": labels_json({"direction": d}),
            "ts": T0 + 5.0 * k,
            "value": 600.0 * k,
        }
        for k in range(20)
        for d in ("in", "out")
    ]
    with db_engine.begin() as conn:
        conn.execute(insert(SeriesPoint.__table__), points)
    f = check(db_engine, "swap_thrashing", instance="vllm-a")
    assert f.present and f.evidence["source"] == "scraped swap counter"
    assert f.evidence["peak_swaps_per_s"] == pytest.approx(240.0)  # 120/s in each direction
    assert f.cost_value is None  # no request rows: not estimated


# --- cold start -----------------------------------------------------------------------------------------


def _run(first_ttft_s: float) -> list[dict[str, Any]]:
    warm = [req(T0 + 0.5 + 0.01 * n, 1000 + n, prefill=2.0, warmup=True) for n in range(5)]
    return warm + [req(T0 + 1.0 + 0.2 * n, n, prefill=first_ttft_s if n < 100 else 0.1) for n in range(250)]


def test_cold_start_present_when_the_first_requests_are_slow(db_engine: Engine) -> None:
    ingest(db_engine, _run(0.4))
    f = check(db_engine, "cold_start")
    assert f.present and f.evidence["metric"] == "ttft_s" and f.evidence["run"] == "r1"
    assert f.evidence["first_p50_s"] == pytest.approx(0.406) and f.evidence["rest_p50_s"] == pytest.approx(0.106)
    assert f.cost_value == pytest.approx(0.3)
    assert f.knob == "warmup.requests" and f.study_command is None  # not hot-reloadable: no study


def test_cold_start_absent_with_warmup_left_out_and_unknown_for_runs_started_earlier(db_engine: Engine) -> None:
    ingest(db_engine, _run(0.1))
    f = check(db_engine, "cold_start")
    assert f.status == "absent" and f.evidence["ratio"] == pytest.approx(1.0)  # the 2-s warm-up rows ignored
    f = check(db_engine, "cold_start", start=T0 + 10.0)
    assert f.status == "no_data" and "started in the window" in f.summary
    ingest(db_engine, [req(T0 + 1.0 + n, n, instance="e1") for n in range(120)])
    f = check(db_engine, "cold_start", instance="e1")
    assert f.status == "no_data" and "too few" in f.summary


# --- the memory wall ------------------------------------------------------------------------------------


def test_memory_wall_present_when_kv_is_full_and_requests_are_preempted(db_engine: Engine) -> None:
    samples = [ev.sample(k, ts=T0 + k, kv_usage=0.97 if k % 10 < 3 else 0.7, fragmentation=0.05) for k in range(100)]
    requests = [req(T0 + n, n, prompt_tokens=600, preemptions=2 if n < 5 else 0) for n in range(60)]
    ingest(db_engine, [*samples, *requests, ev.alloc(0, ts=T0 + 50.0, op="oom")])
    f = check(db_engine, "memory_wall")
    assert f.present and f.severity == "critical"  # a failed allocation
    e = f.evidence
    assert e["full_share"] == pytest.approx(0.3) and e["usage_peak"] == pytest.approx(0.97)
    assert e["failed_allocations"] == 1 and e["preemptions"] == 10 and e["preempted_requests"] == 5
    # per second with traffic (first arrival to last finish: 59.215 s), not per second of the 600-s window
    assert e["traffic_s"] == pytest.approx(59.215) and e["idle_samples_left_out"] == 40
    assert f.cost_value == pytest.approx(5 * 2 * 600 / 59.215)
    assert f.knob == "scheduler.max_num_seqs" and "KV usage" in f.series and "fragmentation" in f.series


def test_memory_wall_leaves_samples_of_an_idle_gap_out(db_engine: Engine) -> None:
    """Full in 5 of the 20 seconds with traffic (25%); the 80 idle seconds after it, at 0, would make it 5%."""
    samples = [ev.sample(k, ts=T0 + k, kv_usage=(0.97 if k % 4 == 0 else 0.6) if k < 20 else 0.0) for k in range(100)]
    requests = [req(T0 + 0.2 * n, n) for n in range(99)]  # arrivals over 0-19.6 s, each in flight 0.215 s
    ingest(db_engine, [*samples, *requests])
    f = check(db_engine, "memory_wall")
    assert f.present and f.evidence["full_share"] == pytest.approx(0.25), f.summary
    assert f.evidence["idle_samples_left_out"] == 80 and "of the samples with traffic" in f.summary


def test_memory_wall_fragmentation_points_at_the_block_policy(db_engine: Engine) -> None:
    ingest(db_engine, [ev.sample(k, ts=T0 + k, kv_usage=0.85, fragmentation=0.3) for k in range(100)])
    f = check(db_engine, "memory_wall")
    assert f.present and f.knob == "block_policy" and "fragmentation" in f.summary


def test_memory_wall_absent_with_room_and_unknown_without_usage(db_engine: Engine) -> None:
    ingest(db_engine, [ev.sample(k, ts=T0 + k, kv_usage=0.5, fragmentation=0.05) for k in range(100)])
    f = check(db_engine, "memory_wall")
    assert f.status == "absent" and f.evidence["usage_peak"] == pytest.approx(0.5)
    ingest(db_engine, [req(T0 + 1.0 + n, n, instance="e1") for n in range(100)])
    assert check(db_engine, "memory_wall", instance="e1").status == "no_data"


def test_memory_wall_for_vllm_from_scrapes_and_from_iteration_steps(db_engine: Engine) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [
                {
                    "instance": "vllm-a",
                    "name": "kv_usage",
                    "labels": labels_json({"engine": "0"}),
                    "ts": T0 + 15.0 * k,
                    "value": 0.99,
                }
                for k in range(20)
            ],
        )
    f = check(db_engine, "memory_wall", instance="vllm-a")
    assert f.present and f.evidence["source"] == "kv_usage gauge" and f.evidence["full_share"] == 1.0
    ingest(
        db_engine, [ev.step(k, instance="vllm-b", ts=T0 + k, kv_blocks_used=60, kv_blocks_total=100) for k in range(50)]
    )
    f = check(db_engine, "memory_wall", instance="vllm-b")
    assert f.status == "absent" and f.evidence["source"].startswith("step rows")
    assert f.evidence["usage_peak"] == pytest.approx(0.6)
    # Preemptions counted in steps only (no request says which): present at a full peak, cost not estimated.
    steps = [
        ev.step(k, instance="vllm-c", ts=T0 + k, kv_blocks_used=96 if k % 20 == 0 else 50, preemptions=int(k % 20 == 0))
        for k in range(50)
    ]
    ingest(db_engine, steps)
    f = check(db_engine, "memory_wall", instance="vllm-c")
    assert f.present and f.evidence["full_share"] == pytest.approx(0.06) and f.evidence["preemptions"] == 3
    assert f.cost_value is None and f.cost.startswith("Not estimated: 3 preemption(s)")


# --- all of them ----------------------------------------------------------------------------------------


def test_diagnose_checks_every_trap_on_every_instance_with_data(db_engine: Engine) -> None:
    ingest(db_engine, _bursty(0.2) + [ev.sample(k, instance="e1", ts=T0 + k, kv_usage=0.99) for k in range(30)])
    found = q.diagnose(db_engine, start=T0, end=T0 + 600.0, now=NOW)
    assert [(f.trap, f.instance) for f in found] == [(t, i) for t in q.TRAPS for i in ("e0", "e1")]
    status = {(f.trap, f.instance): f.status for f in found}
    assert status["bursts", "e0"] == "present" and status["memory_wall", "e1"] == "present"
    assert status["bursts", "e1"] == "no_data" and status["memory_wall", "e0"] == "no_data"
    # An instance asked for by name is diagnosed even without data: every trap says so.
    found = q.diagnose(db_engine, start=T0, end=T0 + 600.0, instances=["ghost"], traps=["memory_wall"], now=NOW)
    assert [(f.instance, f.status) for f in found] == [("ghost", "no_data")]
    with pytest.raises(ValueError, match="unknown trap"):
        q.diagnose(db_engine, start=T0, end=T0 + 1.0, traps=["leaks"])


def test_advice_is_in_the_instances_engines_terms(db_engine: Engine) -> None:
    """A vLLM (its cache_config_info scraped) gets the vLLM study of its own arguments; kvpilot's engine (its
    samples) the study over kvpilot's config key; the engine is on each finding."""
    events = _bursty(0.2) + [{**e, "instance": "e1"} for e in _bursty(0.2)]
    ingest(db_engine, [*events, ev.sample(0, instance="e1", ts=T0 + 1.0, prefix_hit_rate=0.3)])
    config = {"engine": "0", "enable_prefix_caching": "True", "block_size": "16"}
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [{"instance": "e0", "name": "kv_cache_config_info", "labels": labels_json(config), "ts": T0, "value": 1.0}],
        )
    infos = q.engine_infos(db_engine, instances=["e0", "e1", "ghost"])
    assert (infos["e0"].engine, infos["e0"].prefix_caching) == ("vllm", True)
    assert (infos["e1"].engine, infos["e1"].prefix_caching) == ("kvpilot", True)
    assert (infos["ghost"].engine, infos["ghost"].prefix_caching) == (None, None)
    found = {f.instance: f for f in q.diagnose(db_engine, start=T0, end=T0 + 600.0, traps=["bursts"], now=NOW)}
    vllm = shlex.split(found["e0"].study_command or "")
    assert found["e0"].engine == "vllm" and vllm[:4] == ["kvpilot", "tune", "vllm", "study"]
    assert vllm[vllm.index("--workload") + 1] == "stored:e0" and "--knob" not in vllm
    kvpilot = shlex.split(found["e1"].study_command or "")
    assert found["e1"].engine == "kvpilot" and kvpilot[:3] == ["kvpilot", "tune", "study"]
    assert kvpilot[kvpilot.index("--knob") + 1] == "scheduler.max_num_batched_tokens"
