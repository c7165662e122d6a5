"""`kvpilot bench tuner`: pinned profiles, SLOs from each profile's own speed, the sampler rule, the JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.cli import bench_app
from benchmarks.tuner_bench import BenchConfig, choose_sampler, run_tuner_bench
from benchmarks.tuner_landscape import (
    BENCH_PROFILES,
    FROZEN_DIR,
    P99_TTFT_PREFILLS,
    TPOT_DECODES,
    TTFT_PREFILLS,
    derive_slo,
    frozen_profiles,
    pin_profile,
)
from kvpilot.cli import app
from tuner.profile import CostProfile, ProfileError, load_profile, shipped_profiles
from tuner.vllm.calibrate import VllmProfile, load_any_profile

runner = CliRunner()


def _scaled(profile: CostProfile | VllmProfile, factor: float) -> CostProfile | VllmProfile:
    """The same profile on a machine `factor` times slower: every cost coefficient multiplied."""
    if isinstance(profile, VllmProfile):
        elapsed = profile.elapsed.model_copy(update={k: v * factor for k, v in profile.elapsed.model_dump().items()})
        return profile.model_copy(
            update={
                "elapsed": elapsed,
                "overhead_s": profile.overhead_s * factor,
                "overhead_per_seq_s": profile.overhead_per_seq_s * factor,
            }
        )
    linear = profile.linear.model_copy(update={k: v * factor for k, v in profile.linear.model_dump().items()})
    return profile.model_copy(update={"linear": linear})


def test_three_frozen_profiles_ship_and_the_shipped_list_has_three() -> None:
    assert set(frozen_profiles()) == set(BENCH_PROFILES)
    assert set(BENCH_PROFILES) <= set(shipped_profiles())
    kinds = {name: pin_profile(name).kind for name in BENCH_PROFILES}
    assert kinds == {"cpu-2core": "linear", "h200-llama3-8b": "roofline", "vllm-cpu-tiny": "vllm"}
    vllm = load_any_profile("vllm-cpu-tiny")
    assert isinstance(vllm, VllmProfile) and vllm.fit.samples >= 200
    assert "kvpilot vllm calibrate" in vllm.description  # says how it was made
    res = runner.invoke(app, ["sim", "profiles"])
    assert res.exit_code == 0, res.output
    listed = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    assert set(BENCH_PROFILES) <= set(listed)


def test_a_vllm_profile_is_refused_by_the_engine_profile_loader_with_the_reason() -> None:
    with pytest.raises(ProfileError, match="a vLLM profile") as info:
        load_profile("vllm-cpu-tiny")
    assert info.value.field == "kind"


@pytest.mark.parametrize("name", ["cpu-2core", "vllm-cpu-tiny"])
def test_the_slo_scales_with_the_profile_speed(name: str) -> None:
    prof = pin_profile(name).profile
    slo, how = derive_slo(prof, 290, 72, block_tokens=32, page_tokens=8)
    slow, _ = derive_slo(_scaled(prof, 3.0), 290, 72, block_tokens=32, page_tokens=8)
    assert slow.ttft_s == pytest.approx(3 * slo.ttft_s, rel=1e-4)
    assert slow.tpot_s == pytest.approx(3 * slo.tpot_s, rel=1e-4)
    assert slow.p99_ttft_s == pytest.approx(3 * slo.p99_ttft_s, rel=1e-4)
    assert slo.ttft_s == pytest.approx(TTFT_PREFILLS * how["prefill_s"], rel=1e-4)
    assert slo.p99_ttft_s == pytest.approx(P99_TTFT_PREFILLS * how["prefill_s"], rel=1e-4)
    assert slo.tpot_s == pytest.approx(TPOT_DECODES * how["decode_step_s"], rel=1e-4)
    # a longer prompt takes longer to prefill: a looser TTFT SLO
    longer, _ = derive_slo(prof, 600, 72, block_tokens=32, page_tokens=8)
    assert longer.ttft_s > slo.ttft_s


def test_the_cpu_profile_keeps_about_version_1_s_fixed_slos() -> None:
    """The rule was set so the CPU landscape barely moved from the fixed 0.3 s / 30 ms / p99 4 s of version 1."""
    slo, _ = derive_slo(pin_profile("cpu-2core").profile, 290, 72, block_tokens=32, page_tokens=8)
    assert slo.ttft_s == pytest.approx(0.3, rel=0.15)
    assert slo.tpot_s == pytest.approx(0.03, rel=0.15)
    assert slo.p99_ttft_s == pytest.approx(4.0, rel=0.15)


def test_the_pin_is_the_file_hash_and_unknown_profiles_are_refused(tmp_path: Path) -> None:
    frozen = FROZEN_DIR / "cpu-2core.json"
    pinned = pin_profile("cpu-2core")
    assert pinned.sha256 == hashlib.sha256(frozen.read_bytes()).hexdigest() and pinned.frozen
    described = pinned.describe()
    assert described["schema_version"] == 1 and described["path"] == str(frozen)
    assert described["shipped"]["sha256"] == hashlib.sha256(shipped_profiles()["cpu-2core"].read_bytes()).hexdigest()
    # a re-calibrated copy: same name, another hash, and not the frozen file
    data = json.loads(frozen.read_text())
    data["linear"]["c0_s"] *= 1.5
    recal = tmp_path / "cpu-2core.json"
    recal.write_text(json.dumps(data))
    other = pin_profile(recal)
    assert other.name == "cpu-2core" and other.sha256 != pinned.sha256 and not other.frozen
    with pytest.raises(ProfileError, match="not one of the bench's frozen profiles"):
        pin_profile("no-such-profile")
    res = runner.invoke(bench_app, ["tuner", "--quick", "--profile", "no-such-profile"])
    assert res.exit_code == 2 and "no-such-profile" in res.output and "Traceback" not in res.output


def test_the_rule_picks_the_lowest_worst_case_median() -> None:
    medians = {
        "tpe": {"a": 5, "b": 30, "c": 5},  # best on average, worst on b
        "random": {"a": 15, "b": 16, "c": 15},
        "tpe-startup10": {"a": 12, "b": 16, "c": 14},
    }
    missed = {"tpe": 0, "random": 2, "tpe-startup10": 1}
    assert choose_sampler(medians, missed) == "tpe-startup10"  # tie on 16: fewer misses
    assert choose_sampler(medians, {**missed, "random": 0, "tpe-startup10": 0}) == "tpe-startup10"  # lower mean


def test_the_json_carries_all_three_profiles_and_the_comparison() -> None:
    # the smallest config: each grid is the default config alone (a simulation per profile, seconds in all)
    cfg = BenchConfig(quick=True, requests=12, seeds=2, samplers=("tpe", "random"), gain_trials=0, choices_per_knob=0)
    out = run_tuner_bench(profiles=BENCH_PROFILES, config=cfg, progress=lambda _msg: None)
    assert out["bench_version"] >= 2
    assert [p["name"] for p in out["profiles"]] == list(BENCH_PROFILES)
    for p in out["profiles"]:
        assert p["sha256"] == hashlib.sha256(Path(p["path"]).read_bytes()).hexdigest()
        assert p["schema_version"] == 1 and p["frozen_copy"]
    assert set(out["results"]) == set(BENCH_PROFILES)
    for name, r in out["results"].items():
        assert r["grid"]["size"] == 1 and r["grid"]["distinct_configs"] == 1
        assert r["landscape"]["slo_derivation"]["prefill_s"] > 0
        assert set(r["samplers"]) == {"tpe", "random"} and len(r["samplers"]["tpe"]["by_seed"]) == 2
        assert out["sampler_comparison"]["medians"]["tpe"][name] == r["samplers"]["tpe"]["median"]
    assert out["sampler_comparison"]["choice"] in ("tpe", "random")


def test_every_candidate_sampler_is_a_different_search() -> None:
    """Optuna 5 turned multivariate TPE and constant liar on by default: a candidate left to the defaults can
    silently be another candidate. Same seed, same objective: no two candidates propose the same 30 trials."""
    import optuna

    from tuner.study import SAMPLERS, make_sampler

    def objective(trial: optuna.Trial) -> float:
        a = trial.suggest_categorical("a", [8, 16, 32, 64])
        b = trial.suggest_categorical("b", [512, 1024, 2048, 4096])
        c = trial.suggest_categorical("c", ["x", "y", "z"])
        return a * (b == 512) + (c == "y") * 10 + b / 1024

    proposals = {}
    for name in SAMPLERS:
        study = optuna.create_study(
            direction="maximize", sampler=make_sampler(name, seed=0, trials=40, multi_objective=False)
        )
        study.optimize(objective, n_trials=30)
        proposals[name] = [tuple(sorted(t.params.items())) for t in study.trials]
    names = list(proposals)
    same = [(x, y) for i, x in enumerate(names) for y in names[i + 1 :] if proposals[x] == proposals[y]]
    assert not same, f"candidates that search alike: {same}"


def test_vllm_calibrate_without_a_vllm_interpreter_exits_2_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["vllm", "calibrate", "--out", str(out), "--vllm-python", str(tmp_path / "no-python")])
    assert res.exit_code == 2 and "not an executable Python interpreter" in res.output
    assert "Traceback" not in res.output and not out.exists()
