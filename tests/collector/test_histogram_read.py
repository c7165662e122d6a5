"""Percentiles from scraped histogram buckets (collector.queries.histogram_stats) on SQLite and PostgreSQL."""

from __future__ import annotations

import bisect
import math
import random

import pytest
from sqlalchemy import Engine, insert

from collector import queries as q
from collector.exposition import labels_json
from collector.histograms import bucket_quantile
from collector.queries import SeriesId
from collector.schema import ScrapeTarget, SeriesPoint

T0 = 1_760_000_000.0
BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, math.inf)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def _cumulative(observations: list[float]) -> list[float]:
    ordered = sorted(observations)
    return [float(bisect.bisect_right(ordered, b)) for b in BOUNDS]


def _rows(instance: str, labels: dict[str, str], ts: float, observations: list[float]) -> list[dict]:
    rows = [
        {
            "instance": instance,
            "name": "ttft_seconds_bucket",
            "labels": labels_json({**labels, "le": _le(b)}),
            "ts": ts,
            "value": count,
        }
        for b, count in zip(BOUNDS, _cumulative(observations), strict=True)
    ]
    for name, value in (("ttft_seconds_count", len(observations)), ("ttft_seconds_sum", sum(observations))):
        rows.append({"instance": instance, "name": name, "labels": labels_json(labels), "ts": ts, "value": value})
    return rows


def _exact(values: list[float], qv: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(qv * len(ordered))) - 1]


def _bucket_of(value: float) -> tuple[float, float]:
    i = bisect.bisect_left(BOUNDS, value)
    return (0.0 if i == 0 else BOUNDS[i - 1], BOUNDS[i])


def test_bucket_quantile_follows_prometheus() -> None:
    buckets = [(0.1, 4.0), (1.0, 10.0), (math.inf, 10.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.25)  # 0.1 + 0.9 * (5 - 4) / 6
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.05)  # first bucket: from 0
    assert bucket_quantile(0.99, [(0.1, 4.0), (1.0, 10.0), (math.inf, 12.0)]) == 1.0  # in +Inf: highest bound
    assert math.isnan(bucket_quantile(0.5, [(0.1, 4.0), (1.0, 10.0)]))  # no +Inf bucket
    assert math.isnan(bucket_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))  # no observations
    assert bucket_quantile(0.5, [(0.1, 6.0), (1.0, 5.0), (math.inf, 10.0)]) == pytest.approx(0.1 * 5 / 6)
    assert bucket_quantile(-1, buckets) == -math.inf and bucket_quantile(2, buckets) == math.inf


def test_p99_from_buckets_within_bucket_width_and_resets(db_engine: Engine) -> None:
    rng = random.Random(7)
    before = [rng.lognormvariate(-1.5, 0.8) for _ in range(300)]  # observed before the window
    first = [rng.lognormvariate(-1.5, 0.8) for _ in range(500)]
    second = [rng.lognormvariate(-0.5, 0.6) for _ in range(400)]  # after a restart (counter reset)
    a = {"model_name": "m", "engine": "0"}
    b = {"model_name": "m", "engine": "1"}
    rows = _rows("vllm-0", a, T0 - 15, before)  # the scrape before the window: the baseline
    rows += _rows("vllm-0", a, T0 + 15, before + first)
    rows += _rows("vllm-0", a, T0 + 30, second)  # restarted: counts from zero again
    other = [rng.uniform(2.0, 4.0) for _ in range(100)]
    rows += _rows("vllm-0", b, T0 + 5, []) + _rows("vllm-0", b, T0 + 20, other)
    with db_engine.begin() as conn:
        conn.execute(insert(SeriesPoint.__table__), rows)

    per_engine = q.histogram_quantiles(
        db_engine, name="ttft_seconds", start=T0, end=T0 + 60, quantiles=(0.5, 0.99), by=("instance", "engine")
    )
    engine0 = per_engine[SeriesId("vllm-0", (("engine", "0"),))]
    window = first + second
    assert engine0.count == len(window)
    assert engine0.mean == pytest.approx(sum(window) / len(window))
    for qv in (0.5, 0.99):
        lo, hi = _bucket_of(_exact(window, qv))
        got = engine0.quantiles[qv]
        assert got is not None and lo - 1e-9 <= got <= hi + 1e-9, (qv, got, lo, hi)
    engine1 = per_engine[SeriesId("vllm-0", (("engine", "1"),))]
    assert engine1.count == len(other) and 2.5 <= engine1.quantiles[0.99] <= 5.0

    both = q.histogram_quantiles(db_engine, name="ttft_seconds", start=T0, end=T0 + 60, quantiles=(0.99,))
    assert set(both) == {SeriesId("vllm-0")} and both[SeriesId("vllm-0")].count == len(window) + len(other)
    lo, hi = _bucket_of(_exact(window + other, 0.99))
    assert lo <= both[SeriesId("vllm-0")].quantiles[0.99] <= hi

    over_time = q.histogram_quantiles_over_time(
        db_engine, name="ttft_seconds", start=T0, end=T0 + 60, bucket_s=20, quantiles=(0.5,), by=("instance",)
    )
    counts = {p.ts: p.count for p in over_time[SeriesId("vllm-0")]}
    assert counts == {T0: len(first), T0 + 20: len(second) + len(other)}
    with pytest.raises(ValueError, match="unknown histogram"):
        q.histogram_quantiles(db_engine, name="kv_usage", start=T0, end=T0 + 1)


def test_scraped_instances_are_listed_with_their_target_labels(db_engine: Engine) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__).values(
                url="http://127.0.0.1:9400/metrics",
                job="dcgm",
                instance="node-a:9400",
                interval_s=15,
                enabled=True,
                created_at=T0,
                labels=labels_json({"node": "node-a"}),
            )
        )
    (info,) = q.list_instances(db_engine)
    assert (info.name, info.sources, info.jobs, info.labels) == (
        "node-a:9400",
        ("scrape",),
        ("dcgm",),
        {"node": "node-a"},
    )
    (health,) = q.target_health(db_engine)
    assert health.labels == {"node": "node-a"} and health.sample_limit == 10_000
