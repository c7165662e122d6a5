"""collector.queries.engine_peaks on SQLite and PostgreSQL: peaks from every step where steps exist, sampled
figures named as samples otherwise."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, event, insert

from collector import queries as q
from collector.exposition import labels_json
from collector.queries.engine_peaks import KVPILOT_STEPS, NO_DATA, VLLM_SPANS, VLLM_STEPS
from collector.queries.step_rollup import ROLLUP_NOTE
from collector.queries.timeseries import series_instances
from collector.schema import SeriesPoint
from tests.collector import evfactory as ev
from tests.collector.test_queries_contract import ingest

T0 = ev.T0


def _scrape(engine: Engine, instance: str, name: str, points: list[tuple[float, float]], **labels: str) -> None:
    rows = [
        {"instance": instance, "name": name, "labels": labels_json(labels), "ts": T0 + t, "value": v} for t, v in points
    ]
    with engine.begin() as conn:
        conn.execute(insert(SeriesPoint.__table__), rows)


def _vllm(engine: Engine) -> None:
    """A vLLM: steps from its iteration log (queue_depth 0, no samples) and its scraped gauges every 5 s."""
    usage = [3, 9, 43, 40, 12, 5]  # of 64 blocks: the peak falls between two scrapes
    seqs = [2, 5, 21, 19, 6, 1]
    steps = [
        ev.step(i, instance="vllm-a", run_id="vllm-r", ts=T0 + 1 + i * 0.4, kv_blocks_used=u, kv_blocks_total=64,
                num_seqs=n, queue_depth=0)
        for i, (u, n) in enumerate(zip(usage, seqs, strict=True))
    ]  # fmt: skip
    steps.append(ev.step(99, instance="vllm-a", run_id="vllm-r", ts=T0 + 2, kv_blocks_used=64, kv_blocks_total=64,
                         num_seqs=40, warmup=True))  # fmt: skip
    ingest(engine, steps, "vllm-steps")
    _scrape(engine, "vllm-a", "kv_usage", [(0, 0.05), (5, 0.238), (10, 0.1)])
    _scrape(engine, "vllm-a", "running", [(0, 1), (5, 7), (10, 2)])
    _scrape(engine, "vllm-a", "queue_depth", [(0, 0), (5, 4), (10, 0)])


def test_vllm_peaks_come_from_every_step_and_waiting_is_named_sampled(db_engine: Engine) -> None:
    _vllm(db_engine)
    p = q.engine_peaks(db_engine, start=T0, end=T0 + 60, instances=["vllm-a"])
    assert p.kv_usage_peak == 43 / 64 and p.kv_usage_source == VLLM_STEPS
    assert p.running_peak == 21 and p.source == VLLM_STEPS
    assert p.steps == 6  # the warm-up step is left out
    assert p.waiting_peak == 4
    assert p.waiting_source == "scrape samples every 5 s — sampled, not a peak"
    # the run filter reads the same steps; another run has none, so the scrape is all there is
    assert q.engine_peaks(db_engine, start=T0, end=T0 + 60, run_id="vllm-r").kv_usage_peak == 43 / 64
    other = q.engine_peaks(db_engine, start=T0, end=T0 + 60, instances=["vllm-a"], run_id="another")
    assert other.kv_usage_peak == 0.238 and "sampled, not a peak" in other.kv_usage_source
    assert other.running_peak == 7 and other.steps == 0


def test_scrape_only_and_kvpilot_engine_and_nothing(db_engine: Engine) -> None:
    _scrape(db_engine, "sglang-b", "kv_usage", [(0, 0.2), (15, 0.6), (30, 0.3)])
    _scrape(db_engine, "sglang-b", "running", [(0, 3), (15, 9)])
    p = q.engine_peaks(db_engine, start=T0, end=T0 + 60, instances=["sglang-b"])
    assert (p.kv_usage_peak, p.running_peak, p.steps) == (0.6, 9, 0)
    assert p.kv_usage_source == p.source == "scrape samples every 15 s — sampled, not a peak"
    assert p.waiting_peak is None and p.waiting_source == NO_DATA

    # a kvpilot engine: steps carry its queue, samples mark it as kvpilot's (their gauges are not the peak)
    ingest(
        db_engine,
        [
            ev.step(1, kv_blocks_used=30, kv_blocks_total=100, num_seqs=6, queue_depth=9),
            ev.step(2, kv_blocks_used=80, kv_blocks_total=100, num_seqs=12, queue_depth=1),
            ev.sample(3, kv_usage=0.5, queue_depth=2, running=4),
        ],
        "kvpilot",
    )
    k = q.engine_peaks(db_engine, start=T0, end=T0 + 60, instances=["e0"])
    assert (k.kv_usage_peak, k.running_peak, k.waiting_peak) == (0.8, 12, 9)
    assert k.kv_usage_source == k.source == k.waiting_source == KVPILOT_STEPS

    both = q.engine_peaks(db_engine, start=T0, end=T0 + 60)
    assert both.kv_usage_peak == 0.8 and both.running_peak == 12
    assert both.kv_usage_source == KVPILOT_STEPS  # the source of the instance that holds the peak
    _scrape(db_engine, "sglang-b", "kv_usage", [(45, 0.9)])
    sampled_top = q.engine_peaks(db_engine, start=T0, end=T0 + 60)
    assert sampled_top.kv_usage_peak == 0.9 and "sampled, not a peak" in sampled_top.kv_usage_source

    empty = q.engine_peaks(db_engine, start=T0 + 100, end=T0 + 200)
    assert (empty.kv_usage_peak, empty.running_peak, empty.waiting_peak, empty.steps) == (None, None, None, 0)
    assert empty.kv_usage_source == empty.source == NO_DATA


def test_step_load_over_time_is_each_buckets_fullest_step(db_engine: Engine) -> None:
    _vllm(db_engine)  # steps at T0+1.0, 1.4, 1.8, 2.2, 2.6, 3.0 (and a warm-up at T0+2)
    load = q.step_load_over_time(db_engine, start=T0, end=T0 + 60, bucket_s=1.0)
    buckets = load["vllm-a"]
    assert [b.ts for b in buckets] == [T0 + 1, T0 + 2, T0 + 3]
    assert [b.kv_usage for b in buckets] == [43 / 64, 40 / 64, 5 / 64]
    assert [b.running for b in buckets] == [21, 19, 1] and [b.steps for b in buckets] == [3, 2, 1]
    assert q.step_load_over_time(db_engine, start=T0, end=T0 + 60, bucket_s=1.0, run_id="other") == {}
    assert q.step_load_lines(db_engine, start=T0, end=T0 + 60, bucket_s=1.0).sources == {"vllm-a": VLLM_STEPS}


def test_a_vllms_waiting_peak_comes_from_its_requests_queue_times(db_engine: Engine) -> None:
    _vllm(db_engine)
    # scheduled = end - decode - prefill; waiting from scheduled - queue: [2, 5), [3, 4.8), [4.5, 6), [5, 7):
    # three at once from 4.5 to 4.8
    waits = [(2.0, 5.0), (3.0, 4.8), (4.5, 6.0), (5.0, 7.0)]
    requests = [
        ev.request(i, instance="vllm-a", run_id="vllm-r", ts=T0 + sched + 1.5, decode_s=1.0, prefill_s=0.5,
                   queue_s=sched - queued, e2e_s=sched - queued + 1.6)
        for i, (queued, sched) in enumerate(waits)
    ]  # fmt: skip
    requests.append(ev.request(9, instance="vllm-a", run_id="vllm-r", ts=T0 + 6.0, queue_s=0.0))  # never waited
    requests.append(ev.request(8, instance="vllm-a", run_id="vllm-r", ts=T0 + 6.0, queue_s=3.0, warmup=True))
    ingest(db_engine, requests, "vllm-spans")
    p = q.engine_peaks(db_engine, start=T0, end=T0 + 60, instances=["vllm-a"])
    assert (p.waiting_peak, p.waiting_source) == (3, VLLM_SPANS)
    assert p.running_peak == 21 and p.source == VLLM_STEPS  # the rest still from every step


def _fleet(engine: Engine) -> None:
    """20 engines over two minutes: k0..k9 kvpilot engines (steps with their queue, and samples), v0..v9 vLLMs
    (steps from the iteration log, queue 0). Engine i's peaks grow with i; v7 breaks away in the second minute."""
    events = []
    for i in range(10):
        for minute in (0, 1):
            for k, (used, seqs, queue) in enumerate([(10 + i, 2 + i, i), (20 + 2 * i, 4 + i, 2 * i)]):
                t = 60 * minute + 10 + 20 * k + i * 0.1
                events.append(ev.step(len(events), instance=f"k{i}", ts=T0 + t, kv_blocks_used=used,
                                      kv_blocks_total=100, num_seqs=seqs, queue_depth=queue))  # fmt: skip
                v_used = 95 if (i == 7 and minute == 1) else used
                events.append(ev.step(len(events), instance=f"v{i}", run_id="vllm-r", ts=T0 + t, kv_blocks_used=v_used,
                                      kv_blocks_total=100, num_seqs=seqs, queue_depth=0))  # fmt: skip
        events.append(ev.sample(len(events), instance=f"k{i}", ts=T0 + 5))
    ingest(engine, events, "fleet")


def test_step_load_lines_draws_a_few_instances_each_and_a_fleet_as_its_envelope_and_top_lines(
    db_engine: Engine,
) -> None:
    _fleet(db_engine)
    few = q.step_load_lines(db_engine, start=T0, end=T0 + 120, bucket_s=60.0, instances=["k1", "v2"])
    assert few.fleet == [] and few.top == {}
    assert few.lines == q.step_load_over_time(db_engine, start=T0, end=T0 + 120, bucket_s=60.0, instances=["k1", "v2"])
    assert few.sources == {"k1": KVPILOT_STEPS, "v2": VLLM_STEPS}

    fleet = q.step_load_lines(db_engine, start=T0, end=T0 + 120, bucket_s=60.0, max_lines=12, top=3)
    assert fleet.instances == 20 and fleet.sources["k3"] == KVPILOT_STEPS and fleet.sources["v3"] == VLLM_STEPS
    minute = T0 // 60 * 60  # T0 is 20 s into a minute; each engine's two steps of a minute share its bucket
    assert [b.ts for b in fleet.fleet] == [minute, minute + 60]
    first, second = fleet.fleet
    assert first.instances == second.instances == 20
    # per bucket each engine's peak is its second step: used 20 + 2i, running 4 + i, queue 2i (kvpilot's only)
    assert first.kv_usage_max == 0.38 and second.kv_usage_max == 0.95
    assert first.kv_usage_mean == pytest.approx(sum(20 + 2 * i for i in range(10)) / 1000)
    assert second.kv_usage_mean == pytest.approx((2 * sum(20 + 2 * i for i in range(10)) - 34 + 95) / 2000)
    assert (first.running_max, first.running_mean) == (13, pytest.approx(8.5))
    # the vLLMs' queue 0 is not a queue: waiting is over the kvpilot engines alone
    assert (first.waiting_max, first.waiting_mean) == (18, pytest.approx(9.0))
    assert fleet.top == {
        "kv_usage": ["v7", "k9", "v9"],
        "running": ["k9", "v9", "k8"],
        "waiting": ["k9", "k8", "k7"],
    }
    assert sorted(fleet.lines) == ["k7", "k8", "k9", "v7", "v9"]  # only the top instances' lines are read
    assert [b.kv_usage for b in fleet.lines["v7"]] == [0.34, 0.95]
    assert fleet.fleet_source() == f"{KVPILOT_STEPS} + {VLLM_STEPS}"

    # the vLLMs alone: no instance carries a queue, so the envelope has no waiting figure
    vllms = q.step_load_lines(db_engine, start=T0, end=T0 + 120, bucket_s=60.0, run_id="vllm-r", max_lines=5)
    assert vllms.instances == 10 and vllms.top["waiting"] == []
    assert all(b.waiting_max is None and b.waiting_mean is None for b in vllms.fleet)
    # mostly kvpilot engines: the shorter list (the one vLLM) is the one named in the query
    mostly = q.step_load_lines(
        db_engine, start=T0, end=T0 + 120, bucket_s=60.0, instances=[f"k{i}" for i in range(10)] + ["v0"], max_lines=5
    )
    assert mostly.fleet[0].waiting_max == 18 and mostly.fleet[0].waiting_mean == pytest.approx(9.0)
    with pytest.raises(ValueError, match="bucket_s"):
        q.step_load_lines(db_engine, start=T0, end=T0 + 120, bucket_s=0)
    with pytest.raises(ValueError, match="max_lines"):
        q.step_load_lines(db_engine, start=T0, end=T0 + 120, bucket_s=60.0, top=0)


def test_step_load_lines_of_a_long_window_read_the_rollup(db_engine: Engine) -> None:
    _fleet(db_engine)
    fleet = q.step_load_lines(db_engine, start=T0, end=T0 + 3600, bucket_s=60.0, max_lines=12)
    assert all(b.rollup for b in fleet.fleet) and fleet.fleet_source().endswith(ROLLUP_NOTE)
    assert [b.kv_usage_max for b in fleet.fleet] == [0.38, 0.95]
    assert fleet.fleet[0].waiting_mean == pytest.approx(9.0)


def test_step_facts_read_once_serve_the_peaks_and_the_lines_alike(db_engine: Engine) -> None:
    _fleet(db_engine)
    window = {"start": T0, "end": T0 + 120, "instances": [f"k{i}" for i in range(10)] + ["v7"]}
    facts = q.step_facts(db_engine, **window)
    assert facts.pushing == {f"k{i}" for i in range(10)} and not facts.rolled
    assert facts.peaks["v7"] == q.StepPeaks(kv=0.95, running=11, waiting=0, steps=4)

    statements: list[str] = []

    def count(conn: object, cursor: object, sql: str, *args: object) -> None:
        statements.append(sql)

    event.listen(db_engine, "before_cursor_execute", count)
    try:
        peaks = q.engine_peaks(db_engine, **window, facts=facts)
        with_facts = len(statements)
        lines = q.step_load_lines(db_engine, **window, bucket_s=60.0, max_lines=5, facts=facts)
        lines_with_facts = len(statements) - with_facts
        statements.clear()
        assert q.engine_peaks(db_engine, **window) == peaks
        assert len(statements) == with_facts + 2  # the step peaks and the sampling engines, read again
        statements.clear()
        assert q.step_load_lines(db_engine, **window, bucket_s=60.0, max_lines=5) == lines
        assert len(statements) == lines_with_facts + 2
    finally:
        event.remove(db_engine, "before_cursor_execute", count)
    assert lines.top["kv_usage"][0] == "v7" and peaks.kv_usage_peak == 0.95
    for other in ({**window, "end": T0 + 60}, {**window, "instances": None}, {**window, "run_id": "vllm-r"}):
        with pytest.raises(ValueError, match="another window"):
            q.engine_peaks(db_engine, **other, facts=facts)
        with pytest.raises(ValueError, match="another window"):
            q.step_load_lines(db_engine, **other, bucket_s=60.0, facts=facts)


def test_series_instances_reads_only_the_named_engines_samples(db_engine: Engine) -> None:
    _scrape(db_engine, "sglang-b", "kv_usage", [(0, 0.2)])
    ingest(db_engine, [ev.sample(1, instance="e0"), ev.sample(2, instance="e1")], "samples")
    window = {"name": "kv_usage", "start": T0, "end": T0 + 60}
    assert series_instances(db_engine, **window) == {"sglang-b", "e0", "e1"}
    assert series_instances(db_engine, **window, engines=[]) == {"sglang-b"}  # scrapes are always read
    assert series_instances(db_engine, **window, engines=["e1"]) == {"sglang-b", "e1"}
    assert series_instances(db_engine, **window, instances=["e0", "sglang-b"], engines=["e1"]) == {"sglang-b"}
