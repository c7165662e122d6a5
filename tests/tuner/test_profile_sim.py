"""Cost profiles (validation, shipped files, roofline) and the simulator running the engine's own code."""

from __future__ import annotations

import json

import pytest

from engine import workload as W
from engine.clock import VirtualClock
from engine.config import EngineConfig
from tuner.profile import CostProfile, ProfileError, StepShape, load_profile, shipped_profiles
from tuner.replay import TrialSink, replay
from tuner.sim import SimExecutor, sim_engine, step_shape

from .conftest import TINY_BPT, tiny_profile


def test_shipped_profiles_load_and_are_consistent() -> None:
    names = shipped_profiles()
    assert {"cpu-2core", "h200-llama3-8b"} <= set(names)
    cpu = load_profile("cpu-2core")
    assert cpu.kind == "linear" and cpu.fit is not None and cpu.fit.samples > 100
    assert cpu.predict(StepShape(decode_seqs=8, decode_ctx_tokens=800, decode_attn_tokens=800)) > 0
    gpu = load_profile("h200-llama3-8b")
    assert gpu.model.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert gpu.model.weights_bytes == pytest.approx(16e9, rel=0.01)


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    gpu = load_profile("h200-llama3-8b")
    one = gpu.predict(StepShape(decode_seqs=1, decode_ctx_tokens=1000, decode_kv_slots=1024))
    weights_read = gpu.model.weights_bytes / (4.8e12 * 0.8)
    assert weights_read < one < weights_read + 0.003
    # 64 sequences cost far less than 64 single steps (weights are read once per step)
    many = gpu.predict(StepShape(decode_seqs=64, decode_ctx_tokens=64000, decode_kv_slots=64 * 1024))
    assert one < many < 5 * one
    prefill = gpu.predict(
        StepShape(prefill_tokens=8192, prefill_seqs=1, attn_pairs=8192 * 8193 // 2, prefill_ctx_tokens=8192)
    )
    flops = 2 * gpu.model.params * 8192
    assert prefill >= flops / (989e12 * 0.6)


def test_profile_errors_name_the_field(tmp_path) -> None:
    good = json.loads(tiny_profile().to_json())
    bad = json.loads(json.dumps(good))
    bad["model"]["kv_bytes_per_token"] = 1000
    with pytest.raises(ProfileError, match="kv_bytes_per_token") as err:
        CostProfile.from_dict(bad)
    assert err.value.field == "model"
    bad = {**good, "linear": None}
    with pytest.raises(ProfileError, match="needs a `linear` section"):
        CostProfile.from_dict(bad)
    bad = json.loads(json.dumps(good))
    bad["linear"]["decode_seqs"] = -1.0
    with pytest.raises(ProfileError, match=r"linear\.decode_seqs") as err:
        CostProfile.from_dict(bad)
    assert err.value.field == "linear.decode_seqs"
    path = tmp_path / "broken.json"
    path.write_text("{nope")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="not found"):
        load_profile("no-such-profile")
    saved = tiny_profile().save(tmp_path / "p.json")
    assert load_profile(saved) == tiny_profile()
    assert not list(tmp_path.glob("*.tmp"))


def test_sim_executor_advances_the_virtual_clock_by_the_predicted_cost(profile: CostProfile) -> None:
    sink = TrialSink()
    engine, clock = sim_engine(profile.engine_config(None), profile, sink=sink)
    assert isinstance(engine.executor, SimExecutor) and engine.executor.bytes_per_token == TINY_BPT
    reqs = W.mixed(6, seed=3, scale=16, output_range=(3, 6))
    result = replay(engine, reqs)
    assert len(result.finished) == 6
    assert clock.now() == pytest.approx(engine.executor.busy_s)  # all arrivals at 0: never idle
    steps = [e for e in sink.events if e.type == "step"]
    assert sum(e.duration_s for e in steps) == pytest.approx(clock.now())
    assert all(
        f.output_tokens == r.output_tokens
        for f, r in zip(sorted(result.finished, key=lambda f: int(f.request_id[1:])), reqs, strict=True)
    )


def test_step_jitter_spreads_steps_around_the_mean_reproducibly(profile: CostProfile) -> None:
    jittery = profile.model_copy(update={"step_jitter": [0.5, 1.0, 1.5]})
    assert [jittery.jitter(u) for u in (0.0, 0.25, 0.5, 1.0)] == [0.5, 0.75, 1.0, 1.5]
    assert profile.jitter(0.3) == 1.0  # the profile stores none
    reqs = W.mixed(12, seed=5, scale=16, output_range=(3, 8))

    def run(p: CostProfile, seed: int | None) -> tuple[float, int]:
        engine, _ = sim_engine(p.engine_config(None), p, sink=TrialSink(), jitter_seed=seed)
        steps = replay(engine, reqs).steps
        return engine.executor.busy_s, steps  # type: ignore[attr-defined]  # the simulated executor's

    mean_cost = run(profile, None)
    assert run(jittery, None) == mean_cost  # no seed: every step costs the model's mean
    first, again, other = run(jittery, 1), run(jittery, 1), run(jittery, 2)
    assert first == again and first != other
    # all arrivals at 0: the same steps, each scaled by a draw that averages 1
    assert first[1] == mean_cost[1]
    busy = [run(jittery, seed)[0] for seed in range(3, 23)]
    assert sum(busy) / len(busy) == pytest.approx(mean_cost[0], rel=0.05) and min(busy) < mean_cost[0] < max(busy)
    with pytest.raises(ValueError, match="step_jitter"):
        CostProfile.model_validate({**json.loads(profile.to_json()), "step_jitter": [1.2, 0.9]})


def test_small_batches_cost_more_per_row() -> None:
    """The saturating row features: the first rows of a matmul cost more than the later ones."""
    shape = StepShape(prefill_tokens=5, prefill_seqs=1, decode_seqs=3)
    assert (shape.rows, shape.rows_upto_2, shape.rows_upto_8) == (8, 2, 8)
    assert (StepShape(decode_seqs=1).rows_upto_2, StepShape(decode_seqs=40).rows_upto_8) == (1, 8)
    flat = tiny_profile()
    bent = tiny_profile(rows_upto_2=1e-3, rows_upto_8=2e-4)
    extra = [bent.predict(StepShape(decode_seqs=b)) - flat.predict(StepShape(decode_seqs=b)) for b in (1, 2, 4, 8, 32)]
    assert extra == pytest.approx([1.2e-3, 2.4e-3, 2.8e-3, 3.6e-3, 3.6e-3])


def test_profiles_without_the_row_features_still_load(tmp_path) -> None:
    data = json.loads(tiny_profile().to_json())
    for key in ("rows_upto_2", "rows_upto_8"):
        del data["linear"][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert (old.linear.rows_upto_2, old.linear.rows_upto_8) == (0.0, 0.0)
    assert old.predict(StepShape(decode_seqs=4)) == tiny_profile().predict(StepShape(decode_seqs=4))


def test_step_shape_counts_prefill_decode_and_attention() -> None:
    profile = tiny_profile()
    shapes: list[StepShape] = []

    class Spy(SimExecutor):
        def execute(self, out, kv):
            shapes.append(step_shape(out, kv, self.page_tokens))
            return super().execute(out, kv)

    clock = VirtualClock()
    cfg = profile.engine_config(None)
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams

    engine = LLMEngine(cfg, executor=Spy(profile, clock), clock=clock, sink=TrialSink())
    engine.add_request([256] + [1] * 99, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request([256] + [2] * 49, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.run_until_done()
    first = shapes[0]
    assert (first.prefill_seqs, first.prefill_tokens, first.decode_seqs) == (2, 150, 0)
    assert first.attn_pairs == 100 * 101 // 2 + 50 * 51 // 2
    second = shapes[1]
    assert (second.prefill_seqs, second.decode_seqs, second.decode_ctx_tokens) == (0, 2, 101 + 51)
    assert second.decode_blocks == 4 + 2  # 32-token blocks: ceil(101/32), ceil(51/32)
    assert second.decode_attn_tokens == 2 * 104  # one group, padded to the longest row in 8-token pages


def test_simulation_uses_the_real_scheduler_under_memory_pressure() -> None:
    profile = tiny_profile()
    data = profile.engine_config(None).model_dump(mode="json")
    data["cache"].update({"hot_bytes": 256 * 1024, "cold_bytes": 4 * 2**20})  # 512 tokens of KV
    data["scheduler"].update({"preemption_mode": "swap"})
    cfg = EngineConfig.from_dict(data)
    reqs = [W.WorkloadRequest(0.0, 200, 120) for _ in range(12)]
    runs = []
    for _ in range(2):
        engine, clock = sim_engine(cfg, profile, sink=TrialSink())
        result = replay(engine, reqs)
        runs.append((clock.now(), result.preemptions, [f.e2e_s for f in result.finished]))
        engine.kv.check_invariants()
    assert runs[0] == runs[1]  # deterministic
    assert runs[0][1] > 0  # the KV pool ran out: the scheduler preempted (swapped) sequences
    assert len(runs[0][2]) == 12
