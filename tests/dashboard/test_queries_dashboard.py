"""The read functions added to collector.queries for the dashboard, against a Python reference, on SQLite and
PostgreSQL alike (the `db_engine` fixture runs each test on both)."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

import pytest
from sqlalchemy import Engine

from collector import queries
from collector.ingest import parse_batch, store_batch
from plumbing.percentile import nearest_rank
from tests.collector import evfactory as ev

T0 = ev.T0


def _store(engine: Engine, events: list[dict]) -> None:
    body = ev.body(events)
    store_batch(engine, parse_batch(body, max_events=20_000), idempotency_key=None, content=body)


def _requests() -> list[dict]:
    out = []
    for i in range(90):
        ttft = 0.01 + (i * 37 % 23) / 100.0  # scrambled, with ties
        decode = 0.2 + (i % 9) / 50.0
        out.append(
            ev.request(
                0,
                ts=T0 + i * 2.0 + 0.5,
                request_id=f"q{i}",
                queue_s=0.003 * (i % 4),
                prefill_s=0.01,
                ttft_s=ttft,
                decode_s=decode,
                e2e_s=ttft + decode + 0.002,
                output_tokens=1 + i % 12,
                swaps=i % 3,
                preemptions=i % 2,
                instance="e0" if i % 3 else "e1",
                **({"swap_s": 0.04 * (i % 3) + 0.001 * (i % 5)} if i % 3 else {}),
            )
        )
    out.append(ev.request(0, ts=T0 + 50.5, request_id="bad", status="failed", ttft_s=9.0, e2e_s=9.0))
    out.append(ev.request(0, ts=T0 + 51.5, request_id="warm", ttft_s=8.0, warmup=True))
    return out


def test_latency_quantiles_over_time_match_nearest_rank_per_bucket(db_engine: Engine) -> None:
    reqs = _requests()
    _store(db_engine, reqs)
    got = queries.latency_quantiles_over_time(
        db_engine, start=T0, end=T0 + 1000, bucket_s=30.0, metric="ttft", quantiles=(0.5, 0.9, 0.99)
    )
    by_bucket: dict[float, list[float]] = defaultdict(list)
    for r in reqs:
        if r["status"] == "finished" and not r.get("warmup"):
            by_bucket[math.floor(r["ts"] / 30.0) * 30.0].append(r["ttft_s"])
    assert [b.ts for b in got] == sorted(by_bucket)
    for b in got:
        values = by_bucket[b.ts]
        assert b.count == len(values)
        assert b.mean == pytest.approx(statistics.fmean(values))
        for q in (0.5, 0.9, 0.99):
            assert b.quantiles[q] == pytest.approx(nearest_rank(values, q))
    only_e1 = queries.latency_quantiles_over_time(
        db_engine, start=T0, end=T0 + 1000, bucket_s=1000.0, metric="tpot", instances=["e1"]
    )
    tpots = [
        r["decode_s"] / (r["output_tokens"] - 1)
        for r in reqs
        if r["instance"] == "e1" and r["output_tokens"] > 1 and r["status"] == "finished"
    ]
    assert only_e1[0].count == len(tpots)
    assert only_e1[0].quantiles[0.99] == pytest.approx(nearest_rank(tpots, 0.99))


def test_stage_breakdown_adds_up_to_e2e(db_engine: Engine) -> None:
    reqs = _requests()
    _store(db_engine, reqs)
    got = queries.stage_breakdown_over_time(db_engine, start=T0, end=T0 + 1000, bucket_s=60.0)
    finished = [r for r in reqs if r["status"] == "finished" and not r.get("warmup")]
    assert sum(b.requests for b in got) == len(finished)
    assert sum(b.swaps for b in got) == sum(r["swaps"] for r in finished)
    assert any(b.swap_s > 0 for b in got)
    for b in got:
        inside = [r for r in finished if math.floor(r["ts"] / 60.0) * 60.0 == b.ts]
        assert b.queue_s == pytest.approx(statistics.fmean(r["queue_s"] for r in inside))
        assert b.swap_s == pytest.approx(statistics.fmean(r.get("swap_s", 0.0) for r in inside))
        assert b.decode_s == pytest.approx(statistics.fmean(r["decode_s"] for r in inside))
        assert b.decode_excl_swap_s == pytest.approx(b.decode_s - b.swap_s)  # swap < decode in every request
        assert b.queue_s + b.prefill_s + b.first_token_gap_s + b.decode_excl_swap_s + b.swap_s == pytest.approx(b.e2e_s)
        assert b.first_token_gap_s == pytest.approx(
            statistics.fmean(r["e2e_s"] - r["queue_s"] - r["prefill_s"] - r["decode_s"] for r in inside)
        )


def test_swap_percentiles_and_decode_excluding_swap_clamped_at_zero(db_engine: Engine) -> None:
    reqs = _requests()
    # Swapped longer than it decoded (swapped out during prefill): its decode-excluding-swap is 0, not negative.
    reqs.append(ev.request(0, ts=T0 + 2000.5, request_id="long-swap", decode_s=0.1, swap_s=0.3, e2e_s=0.5))
    _store(db_engine, reqs)
    finished = [r for r in reqs if r["status"] == "finished" and not r.get("warmup") and r["ts"] < T0 + 1000]
    swaps = [r.get("swap_s", 0.0) for r in finished]
    (stats,) = queries.latency_percentiles(db_engine, start=T0, end=T0 + 1000, metric="swap", group_by="all")
    assert stats.count == len(finished) and stats.mean == pytest.approx(statistics.fmean(swaps))
    assert stats.max == pytest.approx(max(swaps))
    for q in (0.5, 0.9, 0.99):
        assert stats.quantiles[q] == pytest.approx(nearest_rank(swaps, q))
    (lone,) = queries.stage_breakdown_over_time(db_engine, start=T0 + 2000, end=T0 + 2100, bucket_s=60.0)
    assert (lone.decode_excl_swap_s, lone.swap_s, lone.decode_s) == (0.0, pytest.approx(0.3), pytest.approx(0.1))
    # The swap beyond decode was inside prefill: the gap gives it back, so the stages still add up to e2e.
    assert lone.first_token_gap_s == pytest.approx(0.5 - 0.01 - 0.02 - 0.1 - (0.3 - 0.1))
    assert (
        lone.queue_s + lone.prefill_s + lone.first_token_gap_s + lone.decode_excl_swap_s + lone.swap_s
        == pytest.approx(lone.e2e_s)
    )


def test_latency_histogram_counts_every_request_and_clamps_to_upper(db_engine: Engine) -> None:
    reqs = _requests()
    _store(db_engine, reqs)
    values = [r["ttft_s"] for r in reqs if r["status"] == "finished" and not r.get("warmup")]
    bins = queries.latency_histogram(db_engine, start=T0, end=T0 + 1000, metric="ttft", bins=10)
    assert len(bins) == 10 and sum(b.count for b in bins) == len(values)
    assert bins[0].lo == pytest.approx(min(values)) and bins[-1].hi == pytest.approx(max(values))
    width = (max(values) - min(values)) / 10
    expected = Counter(min(9, math.floor((v - min(values)) / width + 1e-9)) for v in values)
    assert [b.count for b in bins] == [expected.get(i, 0) for i in range(10)]
    clipped = queries.latency_histogram(db_engine, start=T0, end=T0 + 1000, metric="ttft", bins=4, upper=0.1)
    assert clipped[-1].hi == pytest.approx(0.1)
    assert clipped[-1].count == sum(v >= min(values) + 3 * (0.1 - min(values)) / 4 - 1e-12 for v in values)
    assert sum(b.count for b in clipped) == len(values)
    assert queries.latency_histogram(db_engine, start=T0 + 5000, end=T0 + 6000) == []


def test_alloc_ops_and_trace(db_engine: Engine) -> None:
    ops = ["alloc", "free", "swap_out", "swap_in", "evict", "alloc"]
    events = [
        ev.alloc(
            0,
            ts=T0 + i + 0.25,
            op=ops[i % 6],
            blocks=1 + i % 4,
            bytes=1000 * (1 + i % 4),
            tier="cold" if ops[i % 6] == "swap_out" else "hot",
            usage_after=0.5,
        )
        for i in range(60)
    ]
    events.append(ev.alloc(0, ts=T0 + 5.5, instance="e9", op="oom", blocks=7))
    _store(db_engine, events)
    buckets = queries.alloc_ops_over_time(db_engine, start=T0, end=T0 + 100, bucket_s=10.0, instances=["e0"])
    counted = Counter()
    blocks = Counter()
    for b in buckets:
        counted[(b.ts, b.op, b.tier)] += b.events
        blocks[b.op] += b.blocks
    expected = Counter((math.floor((e["ts"]) / 10) * 10.0, e["op"], e["tier"]) for e in events if e["instance"] == "e0")
    assert counted == expected
    assert blocks["alloc"] == sum(e["blocks"] for e in events if e["op"] == "alloc" and e["instance"] == "e0")

    trace = queries.alloc_trace(db_engine, start=T0, end=T0 + 100, limit=10)
    assert trace.total == 61
    assert [e["ts"] for e in trace.events] == sorted(e["ts"] for e in events)[-10:]  # newest 10, in time order
    assert queries.alloc_trace(db_engine, start=T0, end=T0 + 100, ops=["oom"]).events[0]["instance"] == "e9"


def test_latest_samples_takes_each_instances_newest_in_window(db_engine: Engine) -> None:
    _store(db_engine, [ev.sample(i, kv_usage=i / 100.0, instance="e0" if i % 2 else "e1") for i in range(20)])
    got = queries.latest_samples(db_engine, end=T0 + 15)
    assert got["e0"]["kv_usage"] == pytest.approx(0.13) and got["e1"]["kv_usage"] == pytest.approx(0.14)
    assert set(queries.latest_samples(db_engine, end=T0 + 15, instances=["e1"])) == {"e1"}
    assert queries.latest_samples(db_engine, start=T0 + 100, end=T0 + 200) == {}


@pytest.mark.parametrize("bad", [{"bucket_s": 0}, {"quantiles": (1.5,)}])
def test_quantiles_over_time_rejects_bad_arguments(db_engine: Engine, bad: dict) -> None:
    kwargs = {"start": T0, "end": T0 + 10, "bucket_s": 1.0, **bad}
    with pytest.raises(ValueError):
        queries.latency_quantiles_over_time(db_engine, **kwargs)


def test_run_gauges_over_time_keeps_to_the_run(db_engine: Engine) -> None:
    _store(
        db_engine,
        [ev.sample(i, kv_usage=0.1, queue_depth=i, run_id="r1") for i in range(10)]
        + [ev.sample(i, kv_usage=0.9, queue_depth=100, run_id="r2") for i in range(10)],
    )
    got = queries.run_gauges_over_time(
        db_engine, names=["kv_usage", "queue_depth"], start=T0, end=T0 + 10, bucket_s=5.0, run_id="r1"
    )
    assert got["kv_usage"]["e0"] == [(T0, pytest.approx(0.1)), (T0 + 5, pytest.approx(0.1))]
    assert got["queue_depth"]["e0"] == [(T0, pytest.approx(2.0)), (T0 + 5, pytest.approx(7.0))]
    with pytest.raises(ValueError, match="not engine-sampled"):
        queries.run_gauges_over_time(db_engine, names=["up"], start=T0, end=T0 + 10, bucket_s=5.0, run_id="r1")
