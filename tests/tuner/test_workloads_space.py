"""Workloads (scenarios, Azure traces, fitted from the collector) and the search space."""

from __future__ import annotations

import pytest

from collector.db import make_engine
from engine.config import EngineConfig
from tuner import workloads as WL
from tuner.metrics import store_events
from tuner.space import SpaceError, load_space, parse_block_policy, space_from_dict


def test_scenarios_have_their_shape() -> None:
    opts = WL.WorkloadOptions(requests=400, scale=4.0)
    mixed = WL.scenario("mixed", 10.0, opts, seed=1)
    kinds = WL.describe(mixed)["kinds"]
    assert 0.2 < kinds["short"] / 400 < 0.4 and 0.5 < kinds["medium"] / 400 < 0.7 and kinds["long"] > 20
    assert WL.describe(mixed)["rate_rps"] == pytest.approx(9.0, rel=0.15)  # 0.9 x capacity
    burst = WL.scenario("burst", 10.0, WL.WorkloadOptions(requests=200, duration_s=20.0), seed=2)
    at = 20.0 / 2 - 1.0
    inside = sum(at <= r.arrival_s < at + 2.0 for r in burst) / 2.0
    outside = sum(not at <= r.arrival_s < at + 2.0 for r in burst) / 18.0
    assert inside > 3.5 * outside  # +500% for 2 s (Poisson noise allowed)
    sustained = WL.scenario("sustained", 10.0, WL.WorkloadOptions(duration_s=60.0), seed=3)
    assert len(sustained) / 60.0 == pytest.approx(8.0, rel=0.15) and max(r.arrival_s for r in sustained) < 60
    with pytest.raises(WL.WorkloadError, match="unknown scenario") as err:
        WL.scenario("spiky", 10.0, opts)
    assert err.value.field == "workload"
    with pytest.raises(WL.WorkloadError, match="requests: must be >= 1"):
        WL.scenario("mixed", 10.0, WL.WorkloadOptions(requests=0))


def test_azure_trace_replay_with_scaling(tmp_path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,4808,10\n"
        "2023-11-16 18:15:50.6805900,3180,8\n"
        "2023-11-16 18:15:47.6805900,110,27\n"
    )
    reqs = WL.load_trace(path, WL.WorkloadOptions(time_scale=2.0, length_scale=4.0))
    assert [round(r.arrival_s, 3) for r in reqs] == [0.0, 0.5, 2.0]
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(1202, 2), (28, 7), (795, 2)]
    assert reqs[0].kind == "long"
    seconds = tmp_path / "s.csv"
    seconds.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,100,5\n12.0,200,6\n")
    assert [r.arrival_s for r in WL.load_trace(seconds, WL.WorkloadOptions())] == [0.0, 1.5]
    missing = tmp_path / "m.csv"
    missing.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(WL.WorkloadError, match=r"missing column.*GeneratedTokens"):
        WL.load_trace(missing, WL.WorkloadOptions())
    bad = tmp_path / "b.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,2,3\n")
    with pytest.raises(WL.WorkloadError, match=r"b.csv:3: TIMESTAMP 'yesterday'"):
        WL.load_trace(bad, WL.WorkloadOptions())
    with pytest.raises(WL.WorkloadError, match="cannot read"):
        WL.load_trace(tmp_path / "none.csv", WL.WorkloadOptions())


def test_workload_fitted_from_the_collector(sqlite_url: str) -> None:
    from engine.events import RequestEvent

    now = 1_800_000_000.0
    events = []
    arrivals = [now - 660 + i * 0.5 for i in range(120)]  # 2 requests/s for a minute
    arrivals += [now - 600 + k * 60 for k in range(10)]  # then one a minute for ten minutes
    for i, arrival in enumerate(arrivals):
        events.append(
            RequestEvent(
                instance="prod-1",
                run_id="r",
                ts=arrival + 1.0,
                request_id=f"q{i}",
                status="finished",
                prompt_tokens=100 + i,
                output_tokens=20,
                queue_s=0.1,
                prefill_s=0.1,
                ttft_s=0.2,
                decode_s=0.8,
                e2e_s=1.0,
            )
        )
    db = make_engine(sqlite_url)
    store_events(db, events, key_prefix="fit")
    fitted = WL.fit_from_collector(db, WL.WorkloadOptions(hours=1.0), now=now)
    assert fitted.requests == 130
    assert fitted.rates[0] == pytest.approx(2.0, rel=0.05)
    assert fitted.rates[1:] == pytest.approx([1 / 60] * (len(fitted.rates) - 1), abs=1 / 60 + 1e-9)
    assert {s[0] for s in fitted.shapes} == set(range(100, 230))
    sample = fitted.sample(WL.WorkloadOptions(requests=10_000, time_scale=10.0), seed=1)
    assert len(sample) == pytest.approx(130, rel=0.3)
    assert max(r.arrival_s for r in sample) < (now - fitted.start) / 10.0 + 6.0
    with pytest.raises(WL.WorkloadError, match="holds 0 requests") as err:
        WL.fit_from_collector(db, WL.WorkloadOptions(hours=1.0), now=now, instances=["other"])
    assert err.value.field == "hours"
    db.dispose()


def test_default_space_maps_to_valid_configs() -> None:
    base = EngineConfig()
    space = load_space(base=base)
    assert "block_policy" in space.names and "scheduler.preemption_mode" in space.names
    current = space.including(base).from_config(base)
    assert current["block_policy"] == "fixed-32" and current["recycler.threshold"] == 0.85
    assert space.apply(base, current) == base
    cfg = space.apply(
        base,
        {
            "block_policy": "dynamic-256-1024",
            "scheduler.max_num_batched_tokens": 512,
            "scheduler.prefill_chunk_tokens": 2048,
        },
    )
    assert cfg.cache.block_policy == "dynamic" and tuple(cfg.cache.dynamic_thresholds) == (256, 1024)
    assert cfg.scheduler.prefill_chunk_tokens == 512  # clamped to the token budget
    assert parse_block_policy("fixed-64") == {"block_policy": "fixed", "block_size": 64}


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"params": {"model.dim": {"choices": [1]}}}, "params.model.dim", "not a hot-reloadable field"),
        ({"params": {"recycler.mode": {"choices": []}}}, "params.recycler.mode.choices", "non-empty"),
        ({"params": {"recycler.mode": {"choices": ["lazy"]}}}, "params.recycler.mode", "invalid"),
        ({"params": {"recycler.threshold": {"low": 0.9, "high": 0.5}}}, "params.recycler.threshold", "below high"),
        ({"params": {"block_policy": {"choices": ["fixed-33"]}}}, "params.block_policy", "fixed-N"),
        ({"params": {"scheduler.queue_limit": {"lo": 1}}}, "params.scheduler.queue_limit", "unknown key"),
        ({"parameters": {}}, "parameters", "unknown key"),
        # one parser for both spaces (tuner.space.parse_space): a null range end is an error, not a TypeError
        ({"params": {"recycler.threshold": {"low": None, "high": 0.9}}}, "params.recycler.threshold.low", "number"),
        ({"params": {"recycler.threshold": {"high": 0.9}}}, "params.recycler.threshold.low", "both `low`"),
        ({"params": {"recycler.threshold": {"step": 0.1}}}, "params.recycler.threshold", "both `low`"),
        ({"params": {"recycler.threshold": {"choices": [0.8, 0.8]}}}, "params.recycler.threshold.choices", "dup"),
        (
            {"params": {"recycler.threshold": {"choices": [0.8]}}, "fixed": {"model.dim": 8}},
            "fixed.model.dim",
            "not a hot-reloadable field",
        ),
        (
            {"params": {"recycler.threshold": {"choices": [0.8]}}, "fixed": {"block_policy": "fixed-33"}},
            "fixed",
            "fixed values are invalid",
        ),
    ],
)
def test_space_errors_name_the_field(spec: dict, field: str, message: str) -> None:
    with pytest.raises(SpaceError, match=message) as err:
        space_from_dict(spec)
    assert err.value.field == field


def test_grid_and_file_errors(tmp_path) -> None:
    space = space_from_dict(
        {
            "params": {
                "scheduler.max_num_seqs": {"choices": [8, 16]},
                "recycler.threshold": {"low": 0.6, "high": 0.9, "step": 0.1},
            }
        }
    )
    assert len(space.grid()) == 2 * 4
    with pytest.raises(SpaceError, match="not found"):
        load_space(tmp_path / "none.yml")
    (tmp_path / "bad.yml").write_text("params: [1, 2")
    with pytest.raises(SpaceError, match="not valid YAML"):
        load_space(tmp_path / "bad.yml")
