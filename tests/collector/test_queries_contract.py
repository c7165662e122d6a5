"""collector.queries on SQLite and PostgreSQL alike, checked against plain-Python references."""

from __future__ import annotations

import math
import random

import pytest
from sqlalchemy import Engine, insert

from collector import queries as q
from collector.exposition import labels_json
from collector.ingest import parse_batch, store_batch
from collector.queries import SeriesId
from collector.schema import ScrapeTarget, SeriesPoint
from plumbing.percentile import nearest_rank
from tests.collector import evfactory as ev

T0 = ev.T0


def ingest(engine: Engine, events: list[dict], key: str) -> None:
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=key, content=raw)


@pytest.fixture
def requests_db(db_engine: Engine) -> dict[str, list[dict]]:
    rng = random.Random(7)
    by_instance: dict[str, list[dict]] = {"e0": [], "e1": []}
    events = []
    for i in range(301):
        inst = "e0" if i % 3 else "e1"
        e = ev.request(
            i,
            instance=inst,
            run_id=f"run-{inst}",
            ttft_s=round(rng.uniform(0.001, 2.0), 6),
            e2e_s=round(rng.uniform(0.5, 9.0), 6),
            queue_s=round(rng.expovariate(10), 6),
            decode_s=round(rng.uniform(0.1, 3.0), 6),
            output_tokens=rng.choice([1, 2, 10, 50]),
            status="finished" if i % 17 else "failed",
        )
        events.append(e)
        by_instance[inst].append(e)
    events.append(ev.request(999, ttft_s=0.0001, warmup=True))
    no_ttft = ev.request(1000, ttft_s=None)
    events.append(no_ttft)
    by_instance["e0"].append(no_ttft)
    ingest(db_engine, events, "reqs")
    return by_instance


@pytest.mark.parametrize("metric", ["ttft", "e2e", "queue", "decode", "tpot"])
def test_percentiles_are_exact_nearest_rank(db_engine: Engine, requests_db: dict, metric: str) -> None:
    quantiles = (0.0, 0.5, 0.9, 0.95, 0.99, 1.0)
    stats = q.latency_percentiles(db_engine, start=T0, end=T0 + 2000, metric=metric, quantiles=quantiles)
    assert [s.group for s in stats] == ["e0", "e1"]
    for s in stats:
        finished = [e for e in requests_db[s.group] if e["status"] == "finished"]
        if metric == "tpot":
            values = [e["decode_s"] / (e["output_tokens"] - 1) for e in finished if e["output_tokens"] > 1]
        else:
            values = [e[f"{metric}_s"] for e in finished if e[f"{metric}_s"] is not None]
        assert s.count == len(values)
        for p in quantiles:
            assert s.quantiles[p] == pytest.approx(nearest_rank(values, p), rel=1e-12), (metric, p)
        assert s.max == pytest.approx(max(values)) and s.mean == pytest.approx(sum(values) / len(values))


def test_percentiles_by_run_and_overall_and_warmup(db_engine: Engine, requests_db: dict) -> None:
    by_run = q.latency_percentiles(db_engine, start=T0, end=T0 + 2000, group_by="run")
    assert [s.group for s in by_run] == ["run-e0", "run-e1"]  # r1 holds only warm-up and a ttft-less request
    overall = q.latency_percentiles(db_engine, start=T0, end=T0 + 2000, group_by="all", statuses=None)
    assert overall[0].count == 301  # failed included; warm-up and the missing ttft excluded
    with_warmup = q.latency_percentiles(
        db_engine, start=T0, end=T0 + 2000, group_by="all", include_warmup=True, quantiles=(0.0,)
    )
    assert with_warmup[0].quantiles[0.0] == pytest.approx(0.0001)
    window = q.latency_percentiles(db_engine, start=T0, end=T0 + 10, group_by="all")
    assert window[0].count == 9  # ts T0+0..T0+9, i=0 (finished? 0 % 17 == 0 -> failed)


def test_request_rates_and_goodput(db_engine: Engine, requests_db: dict) -> None:
    rates = {r.group: r for r in q.request_rates(db_engine, start=T0, end=T0 + 301)}
    requests_db["e0"].pop()  # the ttft-less request sits at T0 + 1000, outside this window
    e0 = requests_db["e0"]
    fin = [e for e in e0 if e["status"] == "finished"]
    assert rates["e0"].requests == len(e0) and rates["e0"].finished == len(fin)
    assert rates["e0"].failed == len(e0) - len(fin)
    assert rates["e0"].output_tokens_per_s == pytest.approx(sum(e["output_tokens"] for e in fin) / 301)
    good = {g.group: g for g in q.goodput(db_engine, start=T0, end=T0 + 301, ttft_slo_s=1.0, tpot_slo_s=0.05)}
    expected = [
        e
        for e in fin
        if e["ttft_s"] <= 1.0 and (e["output_tokens"] <= 1 or e["decode_s"] <= 0.05 * (e["output_tokens"] - 1))
    ]
    assert good["e0"].good == len(expected) and good["e0"].requests == len(e0)
    assert good["e0"].fraction == pytest.approx(len(expected) / len(e0))


def test_slowest_requests(db_engine: Engine, requests_db: dict) -> None:
    slow = q.slowest_requests(db_engine, start=T0, end=T0 + 2000, metric="e2e", limit=3)
    everything = sorted((e["e2e_s"] for es in requests_db.values() for e in es), reverse=True)
    assert [r["e2e_s"] for r in slow] == pytest.approx(everything[:3])
    assert {"request_id", "instance", "metric_value"} <= set(slow[0])


def test_series_points_from_samples_steps_and_scrapes(db_engine: Engine) -> None:
    ingest(
        db_engine,
        [
            ev.sample(0, kv_usage=0.1, memory_used_bytes=4, memory_total_bytes=16),
            ev.sample(10, kv_usage=0.3, memory_used_bytes=8, memory_total_bytes=16),
            ev.sample(5, kv_usage=None, instance="e1"),
            ev.step(1, duration_s=0.02),
            ev.step(2, duration_s=0.04, warmup=True),
        ],
        "mix",
    )
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [
                {"instance": "vllm-0", "name": "kv_usage", "labels": labels_json({}), "ts": T0 + 3, "value": 0.5},
                {"instance": "vllm-0", "name": "kv_usage", "labels": labels_json({}), "ts": T0 + 1, "value": 0.25},
                {"instance": "gpu-0", "name": "memory_used_bytes", "labels": '{"gpu":"0"}', "ts": T0, "value": 2.0},
                {"instance": "gpu-0", "name": "memory_used_bytes", "labels": '{"gpu":"1"}', "ts": T0, "value": 6.0},
                {"instance": "gpu-0", "name": "memory_total_bytes", "labels": '{"gpu":"0"}', "ts": T0, "value": 8.0},
                {"instance": "gpu-0", "name": "memory_total_bytes", "labels": '{"gpu":"1"}', "ts": T0, "value": 8.0},
                {"instance": "gpu-0", "name": "up", "labels": "{}", "ts": T0, "value": 1.0},
                {"instance": "gpu-0", "name": "up", "labels": "{}", "ts": T0 + 15, "value": 0.0},
            ],
        )
    e0, vllm, gpu0, gpu1 = (
        SeriesId("e0"),
        SeriesId("vllm-0"),
        SeriesId("gpu-0", (("gpu", "0"),)),
        SeriesId("gpu-0", (("gpu", "1"),)),
    )
    kv = q.series_points(db_engine, name="kv_usage", start=T0, end=T0 + 100)
    assert kv == {e0: [(T0, 0.1), (T0 + 10, 0.3)], vllm: [(T0 + 1, 0.25), (T0 + 3, 0.5)]}
    assert q.series_points(db_engine, name="kv_usage", start=T0, end=T0 + 100, instances=["vllm-0"]).keys() == {vllm}
    assert q.series_points(db_engine, name="step_duration_seconds", start=T0, end=T0 + 100) == {
        e0: [(T0 + 1, pytest.approx(0.02))]
    }
    usage = q.series_points(db_engine, name="memory_usage", start=T0, end=T0 + 100)
    assert usage[e0] == [(T0, 0.25), (T0 + 10, 0.5)]
    # each GPU keeps its own usage: a full GPU is never averaged away by an idle one
    assert usage[gpu0] == [(T0, 0.25)] and usage[gpu1] == [(T0, 0.75)]
    one_gpu = q.series_points(db_engine, name="memory_used_bytes", start=T0, end=T0 + 1, labels={"gpu": "1"})
    assert one_gpu == {gpu1: [(T0, 6.0)]}
    assert q.series_points(db_engine, name="up", start=T0, end=T0 + 100) == {
        SeriesId("gpu-0"): [(T0, 1.0), (T0 + 15, 0.0)]
    }
    assert gpu1.all_labels() == (("gpu", "1"), ("instance", "gpu-0"))
    assert set(q.list_series_names()) >= {"kv_usage", "memory_usage", "up", "utilization", "swaps_total"}
    with pytest.raises(ValueError, match="unknown series"):
        q.series_points(db_engine, name="nope", start=T0, end=T0 + 1)


def _reference_buckets(points: list[tuple[float, float]], width: float) -> list[tuple[float, float]]:
    acc: dict[float, list[float]] = {}
    for ts, v in points:
        acc.setdefault(math.floor(ts / width) * width, []).append(v)
    return [(k, sum(vs) / len(vs)) for k, vs in sorted(acc.items())]


def test_bucketed_and_kv_over_time(db_engine: Engine) -> None:
    """Buckets are aligned to the epoch (floor(ts / w) * w), like Prometheus steps."""
    samples = [ev.sample(i, kv_usage=i / 200, fragmentation=0.1, internal_waste=i / 1000) for i in range(120)]
    ingest(db_engine, samples, "kv")
    b = q.bucketed(db_engine, name="kv_usage", start=T0, end=T0 + 120, bucket_s=60)
    expected = _reference_buckets([(e["ts"], e["kv_usage"]) for e in samples], 60)
    assert len(b[SeriesId("e0")]) == len(expected) == 3
    for (ts, v), (ets, evalue) in zip(b[SeriesId("e0")], expected, strict=True):
        assert ts == ets and v == pytest.approx(evalue)
    kv = q.kv_over_time(db_engine, start=T0, end=T0 + 120, bucket_s=30)["e0"]
    expected = _reference_buckets([(e["ts"], e["kv_usage"]) for e in samples], 30)
    assert [k.ts for k in kv] == [ts for ts, _ in expected]
    assert [k.kv_usage for k in kv] == pytest.approx([v for _, v in expected])
    assert sum(k.samples for k in kv) == 120
    assert kv[0].fragmentation == pytest.approx(0.1) and kv[0].cold_usage is None


def test_throughput_over_time(db_engine: Engine) -> None:
    steps = [ev.step(i, ts=T0 + i + 0.5, prefill_tokens=10, decode_tokens=5, busy_s=0.5) for i in range(20)]
    ingest(db_engine, steps, "steps")
    tp = q.throughput_over_time(db_engine, start=T0, end=T0 + 20, bucket_s=10)["e0"]
    assert [t.steps for t in tp] == [10, 10]  # T0 is a multiple of 10
    assert tp[0].prefill_tokens_per_s == pytest.approx(10.0) and tp[0].decode_tokens_per_s == pytest.approx(5.0)
    assert tp[0].busy_fraction == pytest.approx(0.5)
    # a 4-s step that ended just past a bucket's edge ran in the bucket before: its tokens count there
    ingest(db_engine, [ev.step(31, instance="e9", duration_s=4.0, decode_tokens=400, prefill_tokens=0)], "long")
    (long,) = q.throughput_over_time(db_engine, start=T0, end=T0 + 40, bucket_s=10, instances=["e9"])["e9"]
    assert long.ts == T0 + 20 and long.decode_tokens_per_s == pytest.approx(40.0)


def test_counter_increase_handles_resets(db_engine: Engine) -> None:
    values = [0, 5, 10, 2, 6]  # restart after 10
    with db_engine.begin() as conn:
        conn.execute(
            insert(SeriesPoint.__table__),
            [
                {"instance": "v", "name": "preemptions_total", "labels": "{}", "ts": T0 + 10 * i, "value": v}
                for i, v in enumerate(values)
            ],
        )
    assert q.counter_increase(db_engine, name="preemptions_total", start=T0, end=T0 + 100) == {SeriesId("v"): 16.0}
    assert q.counter_rate(db_engine, name="preemptions_total", start=T0, end=T0 + 100) == {SeriesId("v"): 0.4}


def test_instances_runs_and_target_health(db_engine: Engine) -> None:
    ingest(db_engine, [ev.sample(1), ev.sample(2, instance="e1", run_id="x")], "a")
    assert [i.name for i in q.list_instances(db_engine)] == ["e0", "e1"]
    assert {(r.instance, r.run_id) for r in q.list_runs(db_engine)} == {("e0", "r1"), ("e1", "x")}
    assert [r.run_id for r in q.list_runs(db_engine, instance="e1")] == ["x"]
    with db_engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__).values(
                url="http://h:1/metrics",
                job="j",
                instance="h:1",
                interval_s=5,
                enabled=True,
                up=False,
                last_error="boom",
                last_scrape_at=T0,
                scrape_duration_s=0.1,
                created_at=T0,
            )
        )
    (health,) = q.target_health(db_engine)
    assert health.up is False and health.last_error == "boom"


def test_pushed_rejections_and_ooms_read_as_counters(db_engine: Engine) -> None:
    """Engines that only push events still feed requests_rejected_total / oom_total (the alert rules'
    counters): cumulative counts at each sample, so increase() over a window sees every event."""
    events = [ev.sample(i) for i in range(0, 10)]
    events += [ev.request(100 + i, ts=ev.T0 + 2.5 + i, status="rejected") for i in range(3)]
    events += [ev.request(200, ts=ev.T0 + 3.2)]  # finished: not counted
    events += [ev.alloc(300, ts=ev.T0 + 6.5, op="oom")]
    raw = ev.body(events)
    store_batch(db_engine, parse_batch(raw, max_events=1000), idempotency_key="counters", content=raw)
    with db_engine.connect() as conn:
        rejected = q.series_points(conn, name="requests_rejected_total", start=ev.T0, end=ev.T0 + 10)[SeriesId("e0")]
        oom = q.series_points(conn, name="oom_total", start=ev.T0, end=ev.T0 + 10)[SeriesId("e0")]
    assert [v for _, v in rejected] == [0, 0, 0, 1, 2, 3, 3, 3, 3, 3]
    assert [v for _, v in oom] == [0] * 7 + [1] * 3


def test_headline_latency_is_user_facing_and_names_its_source(db_engine: Engine) -> None:
    """TTFT/e2e from the HTTP arrival (engine stage + the stage before the engine); NULL stage named."""
    rng = random.Random(11)
    events, user_ttft, user_e2e = [], [], []
    for i in range(120):
        frontend = round(rng.uniform(0.0, 0.7), 6) if i % 4 else None  # a quarter not measured
        ttft, e2e = round(rng.uniform(0.01, 0.3), 6), round(rng.uniform(0.4, 2.0), 6)
        events.append(ev.request(i, instance="v", ttft_s=ttft, e2e_s=e2e, frontend_s=frontend))
        user_ttft.append(ttft + (frontend or 0.0))
        user_e2e.append(e2e + (frontend or 0.0))
    events.append(ev.request(500, instance="v", ttft_s=5.0, e2e_s=9.0, frontend_s=1.0, status="failed"))
    ingest(db_engine, events, "headline")
    got = q.headline_latency(db_engine, start=T0 - 10, end=T0 + 10_000, instances=["v"])
    assert got.requests == 120 and got.unmeasured == 30
    assert got.ttft_p50_s == pytest.approx(nearest_rank(user_ttft, 0.5))
    assert got.ttft_p99_s == pytest.approx(nearest_rank(user_ttft, 0.99))
    assert got.e2e_p50_s == pytest.approx(nearest_rank(user_e2e, 0.5))
    assert got.e2e_p99_s == pytest.approx(nearest_rank(user_e2e, 0.99))
    assert "HTTP arrival" in got.source and "30 of 120" in got.source
    none = q.headline_latency(db_engine, start=T0 - 10, end=T0 + 10_000, instances=["nobody"])
    assert (none.requests, none.ttft_p99_s, none.source) == (0, None, "no finished requests in the window")
    buckets = q.stage_breakdown_over_time(db_engine, start=T0 - 10, end=T0 + 10_000, bucket_s=30.0)
    assert sum(b.e2e_s * b.requests for b in buckets) == pytest.approx(sum(user_e2e))  # user-facing e2e
    assert all(b.e2e_s >= b.frontend_s + b.queue_s + b.prefill_s for b in buckets)
