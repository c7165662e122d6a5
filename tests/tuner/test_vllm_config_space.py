"""vLLM's tuned arguments (`integrations.vllm.config`), their search space, and infeasible trials in a study.

No vLLM needed: the check against vLLM's own parser is tests/vllm/test_tune_vllm.py (marker vllm)."""

from __future__ import annotations

import math

import pytest

from integrations.vllm.argcheck import probes
from integrations.vllm.config import VllmConfig, VllmConfigError
from tuner.backends import InfeasibleTrialError
from tuner.metrics import SLO, TrialMetrics
from tuner.space import SpaceError
from tuner.study import run_study
from tuner.vllm.space import load_vllm_space, vllm_space_from_dict


def test_config_renders_vllm_arguments_and_its_config_file(tmp_path) -> None:
    cfg = VllmConfig(model="/m", max_num_seqs=32, enable_prefix_caching=False, extra_args=("--seed", "3", "--x-flag"))
    args = cfg.to_args()
    assert args[:6] == ["--model", "/m", "--dtype", "float32", "--max-model-len", "512"]
    assert args[args.index("--max-num-seqs") : args.index("--max-num-seqs") + 2] == ["--max-num-seqs", "32"]
    assert "--no-enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert "--gpu-memory-utilization" not in args and "--max-num-partial-prefills" not in args  # None: not passed
    assert args[-3:] == ["--seed", "3", "--x-flag"]
    text = cfg.to_config_yaml()
    assert text.startswith("# vLLM engine arguments") and "max-num-seqs: 32\n" in text
    assert "enable-prefix-caching: false\n" in text and "seed: '3'\n" in text and "x-flag: true\n" in text
    path = tmp_path / "proposal.yaml"
    path.write_text(text)
    back = VllmConfig.from_config_yaml(path)
    assert back.tunable() == cfg.tunable() and back.model == "/m"
    assert set(back.extra_args) == {"--seed", "3", "--x-flag"}
    assert cfg.changed(back) == [] and VllmConfig().changed(cfg) == [
        ("max_num_seqs", 128, 32),
        ("enable_prefix_caching", True, False),
    ]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_num_seqs": 256, "max_num_batched_tokens": 128}, "must be >= max_num_seqs"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 256}, "without chunked prefill"),
        ({"long_prefill_token_threshold": 1024}, "must be <= max_model_len"),
        ({"extra_args": ("--port", "1")}, "set by the tuner"),
        ({"extra_args": ("--disable-log-stats",)}, "would stop its telemetry"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_config_refuses_what_vllm_would_refuse(changes: dict, message: str) -> None:
    with pytest.raises(VllmConfigError, match=message):
        VllmConfig.from_dict({"model": "/m", **changes})


def test_shipped_space_loads_and_resolves_the_budget_without_chunked_prefill() -> None:
    base = VllmConfig(model="/m")
    space = load_vllm_space(base=base)
    assert set(space.names) >= {"max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"}
    assert "max_num_partial_prefills" not in space.names
    cfg = space.apply(base, {"enable_chunked_prefill": False, "max_num_batched_tokens": 256})
    assert cfg.max_num_batched_tokens == 512  # raised to max_model_len, as vLLM does for its own default
    assert space.apply(base, {"max_num_batched_tokens": 256}).max_num_batched_tokens == 256
    assert space.from_config(base)["block_size"] == 128
    odd = base.replace(max_num_seqs=48)
    assert 48 in next(p for p in space.including(odd).params if p.name == "max_num_seqs").choices
    planned = probes(space, base)
    assert planned[0]["label"] == "base" and len(planned) == 1 + sum(len(p.choices) for p in space.params)
    assert all(p["args"] for p in planned)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"params": {"max_num_partial_prefill": {"choices": [1, 2]}}}, "params.max_num_partial_prefill"),
        ({"params": {"max_num_seqs": {"choices": []}}}, "params.max_num_seqs.choices"),
        ({"params": {"max_num_seqs": {"low": 64, "high": 8}}}, "params.max_num_seqs"),
        ({"params": {"long_prefill_token_threshold": {"choices": [0, 4096]}}}, "params.long_prefill_token_threshold"),
        ({"params": {"max_num_seqs": {"choices": [8]}}, "fixed": {"max_num_seqs": 8}}, "fixed.max_num_seqs"),
        ({"params": {"block_size": {"choices": [32]}}, "extra": 1}, "extra"),
        ({"params": {"max_num_seqs": {"low": 8}}}, "params.max_num_seqs.high"),
        ({"params": {"max_num_seqs": {"choices": [8, 8]}}}, "params.max_num_seqs.choices"),
        (
            {"params": {"max_num_seqs": {"choices": [8]}}, "fixed": {"max_num_partial_prefill": 2}},
            "fixed.max_num_partial_prefill",
        ),
        ({"params": {"max_num_seqs": {"choices": [8]}}, "fixed": {"block_size": 0}}, "fixed"),
    ],
)
def test_bad_spaces_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(SpaceError) as err:
        vllm_space_from_dict(data, base=VllmConfig(model="/m"))
    assert err.value.field == field


class _FakeVllm:
    """A backend whose engine refuses 8-token blocks and scores configs by max_num_seqs."""

    name = "fake-vllm"

    def __init__(self) -> None:
        self.calls = 0

    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        self.calls += 1
        if config.max_num_seqs == 16:
            raise InfeasibleTrialError("vLLM exited with -9 during the replay: Killed (out of memory)")
        good = float(config.max_num_seqs)
        return TrialMetrics(run_id, 1.0, 10, 10, 0, 0, good, good, 1.0, 1.0, 0.0, 0.1, 0.2, 0.01, 0.5, 0.9, 0, 0)


def test_an_infeasible_config_is_a_trial_with_its_reason_not_the_end_of_the_study() -> None:
    base = VllmConfig(model="/m", max_num_seqs=8)
    space = vllm_space_from_dict({"params": {"max_num_seqs": {"choices": [8, 16, 32]}}}, base=base)
    backend = _FakeVllm()
    result = run_study(backend, space, base, name="t", trials=6, slo=SLO(), random_baseline=False, progress=False)
    assert result.measured == 3 and backend.calls == 3  # the space is exhausted: repeats are told stored results
    infeasible = [t for t in result.trials if t.infeasible]
    assert infeasible and all(t.params == {"max_num_seqs": 16} and not t.feasible for t in infeasible)
    assert "out of memory" in infeasible[0].infeasible and infeasible[0].state == "COMPLETE"
    assert result.best.params == {"max_num_seqs": 32} and result.baseline.params == {"max_num_seqs": 8}


class _SeedFake:
    """A simulator stand-in: 32 sequences add 20 goodput on every seed; 64-token blocks add 5 on seed 0 and cost
    1 on seed 1 (+1.6% on average: inside the noise, since it does not help on every seed)."""

    name = "fake-sim"

    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        good = 100.0 + (20.0 if config.max_num_seqs == 32 else 0.0)
        good += (5.0, -1.0)[seed] if config.block_size == 64 else 0.0
        return TrialMetrics(run_id, 1.0, 10, 10, 0, 0, good, good, 1.0, 1.0, 0.0, 0.1, 0.2, 0.01, 0.5, 0.9, 0, 0)


def test_the_screen_prunes_each_candidate_with_nightlys_rule() -> None:
    from tuner.vllm.screen import LiveMeasurement, screen

    base = VllmConfig(model="/m", max_num_seqs=8)
    space = vllm_space_from_dict(
        {
            "params": {
                "max_num_seqs": {"choices": [8, 32]},
                "block_size": {"choices": [128, 64]},
                "enable_prefix_caching": {"choices": [True, False]},  # no effect at all
            }
        },
        base=base,
    )
    fake = _SeedFake()
    baseline = LiveMeasurement(base, space.from_config(base), None, False)
    result = screen(
        fake, fake, space, base, baseline=baseline, sim_trials=8, top_k=1, slo=SLO(), seeds=[0, 1], name="t"
    )  # fmt: skip
    # the simulated study finds the grid's best (32 sequences, 64-token blocks), whatever the default sampler
    assert {k: result.sim.best.params[k] for k in ("max_num_seqs", "block_size")} == {
        "max_num_seqs": 32,
        "block_size": 64,
    }
    (confirmed,) = result.confirmed
    assert base.changed(confirmed.config) == [("max_num_seqs", 8, 32)]
    records = {r["knob"]: r for r in confirmed.pruning}
    assert records["max_num_seqs"]["kept"] and records["max_num_seqs"]["effect"] > 0.15
    # The old screen's rule (put back when reverting loses < 1% of the mean) kept 64-token blocks: reverting them
    # loses 1.6% on average, but it gains on seed 1, so the change is noise and goes.
    assert not records["block_size"]["kept"] and 0.01 < records["block_size"]["effect"] < 0.02
    assert "block_size" in confirmed.reverted and confirmed.goodput == 120.0 and confirmed.sim_goodput == 120.0


def test_a_change_whose_revert_cannot_run_stays() -> None:
    from tuner.prune import drop_noise_knobs, seed_measurer

    base = VllmConfig(model="/m", max_num_seqs=256, max_num_batched_tokens=2048)
    space = load_vllm_space(base=base)
    found = {**space.from_config(base), "max_num_seqs": 64, "max_num_batched_tokens": 128}
    measure = seed_measurer(_SeedFake(), space, base, slo=SLO(), seeds=[0, 1], name="t")
    kept, records = drop_noise_knobs(space.from_config(base), found, measure, min_effect=0.01)
    # 256 sequences on a 128-token budget is a config vLLM refuses: the change to 64 cannot be reverted alone
    assert [(r["knob"], r["kept"], r["slo"]) for r in records] == [
        ("max_num_seqs", True, True),
        ("max_num_batched_tokens", False, False),
    ]
    assert base.changed(space.apply(base, kept)) == [("max_num_seqs", 256, 64)]


def test_a_vllm_proposal_is_published_as_config_file_report_and_row(sqlite_url: str, tmp_path) -> None:
    from collector.db import make_engine
    from tuner.compare import Comparison, interval, verdict
    from tuner.proposals import get_proposal
    from tuner.study import StudyResult
    from tuner.vllm.proposal import publish, render_report
    from tuner.vllm.screen import LiveMeasurement, ScreenResult

    base = VllmConfig(model="/m")
    best = base.replace(block_size=32, kv_cache_memory_bytes=64 * 2**20)
    metrics = {"goodput_tps": 1000.0, "throughput_tps": 1100.0, "ttft_p99_s": 0.5, "tpot_p99_s": 0.02}
    screened = ScreenResult(
        sim=StudyResult(name="s", sampler="tpe", multi_objective=False, trials=[]),
        baseline=LiveMeasurement(base, {}, metrics, True, sim_goodput=990.0),
        confirmed=[LiveMeasurement(best, {}, {**metrics, "goodput_tps": 1300.0}, True, sim_goodput=1310.0)],
    )
    pairs = [
        {"seed": s, "running": [2.0, 2.1], "candidate": [2.5, 2.6], "replays": 12, "log_ratio": math.log(1.24)}
        for s in (1, 2)
    ]
    heldout = Comparison("running", "candidate", 0.03, [1, 2], pairs, interval([p["log_ratio"] for p in pairs]))
    heldout.verdict = verdict(heldout.interval, margin=0.03)
    capacities = [
        {"config": base, "predicted_capacity_rps": 2.2, "live_capacity_rps": 2.0, "live": {"replays": 6}},
        {"config": best, "predicted_capacity_rps": 2.9, "live_capacity_rps": 2.6, "live": {"replays": 5}},
    ]
    report = render_report(
        title="t", decision="propose", workload={"scenario": "sustained"}, slo=SLO(), base=base, best=best,
        screened=screened, capacities=capacities, heldout=heldout, notes=["extra memory: 16 MiB -> 64 MiB"],
    )  # fmt: skip
    assert heldout.verdict == "proposal" and "serves +24.0% traffic at the same SLOs (90% interval" in report
    assert "| `--block-size` | 128 | 32 |" in report and "| `--kv-cache-memory-bytes` |" in report
    assert "| 1 | 2.00, 2.10 | 2.50, 2.60 | 1.240 | 12 |" in report and "- extra memory: 16 MiB" in report
    assert "at least 1.0% on average" in report and "p99 TPOT within 0.1 s" in report
    assert "| block_size=32, kv_cache_memory_bytes=67108864 | — | 1,300.0 | True |" in report
    assert "| block_size=32, kv_cache_memory_bytes=67108864 | 2.90 | 2.60 | 5 |" in report
    db = make_engine(sqlite_url)
    p = publish(
        db, tmp_path, name="s", instance="tuner-vllm", base=base, best=best, report_md=report,
        baseline_metrics={}, best_metrics={"confirmation": {"gain": 0.25}},
    )  # fmt: skip
    assert p.config_path.name == f"proposal-{p.row.id}.yaml" and VllmConfig.from_config_yaml(p.config_path) == best
    assert f"--config proposal-{p.row.id}.yaml" in p.report_path.read_text()
    row = get_proposal(db, p.row.id)
    assert row.engine == "vllm" and row.status == "pending" and row.gain == 0.25
    assert row.best_metrics["changed"] == {"block_size": 32, "kv_cache_memory_bytes": 64 * 2**20}
    assert not list(tmp_path.glob(".*.tmp"))
    db.dispose()


def test_a_candidate_that_met_the_slos_goes_to_the_held_out_check() -> None:
    """Even when the running config measured more on the tuning seed: one replay cannot settle that."""
    from tuner.study import StudyResult
    from tuner.vllm.screen import LiveMeasurement, ScreenResult

    base = VllmConfig(model="/m")
    running = LiveMeasurement(base, {}, {"goodput_tps": 900.0}, True)
    slower = LiveMeasurement(base.replace(max_num_seqs=64), {}, {"goodput_tps": 800.0}, True)
    faster = LiveMeasurement(base.replace(max_num_seqs=32), {}, {"goodput_tps": 850.0}, True)
    refused = LiveMeasurement(base.replace(max_num_seqs=16), {}, None, False, infeasible="vLLM refused it")
    sim = StudyResult(name="s", sampler="tpe", multi_objective=False, trials=[])
    assert ScreenResult(sim, running, [slower, faster, refused]).best is faster
    assert ScreenResult(sim, running, [refused]).best is running  # nothing met the SLOs live: no held-out check


def test_a_confirmation_the_client_could_not_measure_is_never_proposed() -> None:
    from tuner.backends import NotMeasuredError
    from tuner.vllm.screen import live_measurement

    class Lagging:
        name = "vllm"

        def evaluate(self, config, *, run_id: str, seed: int):
            raise NotMeasuredError("not measured: the replay client sent late in all 3 attempts")

    m = live_measurement(Lagging(), VllmConfig(model="/m"), {}, seeds=[0], slo=SLO(), name="c")
    assert not m.feasible and m.metrics is None and m.goodput == 0.0
    assert m.infeasible == "not measured: the replay client sent late in all 3 attempts"
