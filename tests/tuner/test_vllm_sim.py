"""The simulator in vLLM's mode: the scheduler options, the calibration from stored steps, the workload from
stored request rows, and the simulated trial. No vLLM needed."""

from __future__ import annotations

import random

import pytest

from collector.db import make_engine
from collector.queries import StoredStep, stored_steps
from engine.config import CacheConfig, ModelConfig, RecyclerConfig, SchedulerConfig
from engine.events import RequestEvent, StepEvent
from engine.kv import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, StageTimes
from integrations.vllm.config import VllmConfig
from tuner import workloads as WL
from tuner.metrics import SLO, store_events
from tuner.vllm.calibrate import CalibrationError, fit_profile
from tuner.vllm.sim import VllmSimBackend, sim_vllm_engine

BPT = 64
CKPT_MODEL = ModelConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=688, max_position=2048)


def _scheduler(**sched: object) -> Scheduler:
    cache = CacheConfig(page_tokens=16, block_size=16, hot_bytes=256 * 16 * BPT, cold_bytes=0)
    kv = KVCacheManager(cache, bytes_per_token=BPT, watermark=0.0)
    return Scheduler(SchedulerConfig(**sched), RecyclerConfig(), kv, eos_token_id=2, max_model_len=4096)


def _seq(i: int, n: int, at: float = 0.0) -> Sequence:
    return Sequence(i, f"r{i}", [i % 200 + 3] * n, SamplingParams(max_tokens=4, ignore_eos=True), 1, StageTimes(at))


def _step(s: Scheduler, now: float) -> dict[int, int]:
    out = s.schedule(now)
    s.update(out, [7 if item.samples else None for item in out.scheduled], now)
    s.kv.check_invariants()
    return {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_the_budget_whole() -> None:
    chunked = _scheduler(max_num_batched_tokens=300, prefill_chunk_tokens=300)
    whole = _scheduler(max_num_batched_tokens=300, prefill_chunk_tokens=300, enable_chunked_prefill=False)
    for s in (chunked, whole):
        s.add(_seq(0, 200))
        s.add(_seq(1, 200, at=0.001))
    assert _step(chunked, 0.01) == {0: 200, 1: 100}  # the second prompt starts with what is left
    assert _step(whole, 0.01) == {0: 200}  # ... or waits for a step it fits in whole
    assert _step(whole, 0.02) == {0: 1, 1: 200}
    # vLLM's long-prefill threshold still cuts prompts without chunked prefill: the piece must fit whole
    capped = _scheduler(max_num_batched_tokens=300, prefill_chunk_tokens=64, enable_chunked_prefill=False)
    capped.add(_seq(0, 200))
    capped.add(_seq(1, 200, at=0.001))
    assert _step(capped, 0.01) == {0: 64, 1: 64}


def test_long_prefill_threshold_applies_only_while_another_request_is_there() -> None:
    vllm = _scheduler(max_num_batched_tokens=512, prefill_chunk_tokens=64, chunk_lone_prefill=False)
    vllm.add(_seq(0, 300))
    assert _step(vllm, 0.0) == {0: 300}  # alone: the whole budget, as vLLM
    vllm.add(_seq(1, 300, at=0.1))
    vllm.add(_seq(2, 300, at=0.2))
    assert _step(vllm, 0.3) == {0: 1, 1: 64, 2: 64}
    kvpilot = _scheduler(max_num_batched_tokens=512, prefill_chunk_tokens=64)
    kvpilot.add(_seq(0, 300))
    assert _step(kvpilot, 0.0) == {0: 64}  # kvpilot's own engine chunks every prefill


def _synthetic_steps(n: int, *, seed: int = 0, block: int = 128) -> list[StepEvent]:
    """Steps of a known cost: elapsed = 2 ms + 20 us/prefill token + 0.3 ms/decode seq; 1.5 ms around each."""
    rng = random.Random(seed)
    out, ts = [], 1_800_000_000.0
    for i in range(n):
        decode = rng.randint(0, 24)
        prefill_seqs = rng.choice([0, 0, 1, 2]) if decode else rng.randint(1, 3)
        prefill = sum(rng.randint(16, 300) for _ in range(prefill_seqs))
        elapsed = (0.002 + 2e-5 * prefill + 3e-4 * decode) * rng.uniform(0.9, 1.1)
        ts += elapsed + 0.0015
        used = min(64, (prefill + 150 * decode) // block + 1)
        out.append(
            StepEvent(
                instance="vllm-a",
                run_id="cal",
                ts=ts,
                step=i,
                duration_s=elapsed,
                forward_s=elapsed,
                num_seqs=decode + prefill_seqs,
                prefill_tokens=prefill,
                decode_tokens=decode,
                kv_blocks_used=used,
                kv_blocks_total=64,
                queue_depth=0,
                busy_s=elapsed,
            )
        )
    return out


def test_cost_model_fitted_from_stored_steps(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    events = _synthetic_steps(600)
    store_events(db, events, key_prefix="cal")
    steps = stored_steps(db, start=0, end=2e9, instances=["vllm-a"])
    assert len(steps) == 600 and isinstance(steps[0], StoredStep) and steps[0].step == 0
    profile = fit_profile(steps, model=CKPT_MODEL, block_size=128)
    assert profile.model.kv_bytes_per_token == 2048  # 2 x 4 layers x 2 KV heads x 32 dims x 4 bytes
    assert profile.fit.r2 > 0.9 and abs(profile.source["elapsed_total_ratio"] - 1.0) < 0.03
    assert profile.overhead_s + 10 * profile.overhead_per_seq_s == pytest.approx(0.0015, abs=4e-4)
    real = sum(e.duration_s for e in events)
    predicted = sum(profile.predict(_shape(s), s.num_seqs)[1] for s in steps)
    assert predicted == pytest.approx(real, rel=0.03)
    with pytest.raises(CalibrationError, match="need >= 200"):
        fit_profile(steps[:50], model=CKPT_MODEL, block_size=128)
    back = profile.load(profile.save(sqlite_url.split("///")[1] + ".profile.json"))
    assert back == profile
    db.dispose()


def _shape(step: StoredStep):
    from tuner.vllm.calibrate import step_shape

    return step_shape(step, 128)


def test_workload_from_stored_request_rows(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    rows = [  # (finished at, e2e, prompt, output, status)
        (100.0, 2.0, 300, 40, "finished"),
        (101.5, 0.5, 20, 5, "finished"),
        (103.0, 4.0, 900, 100, "finished"),
        (104.0, 0.1, 50, 0, "rejected"),
    ]
    events = [
        RequestEvent(
            instance="vllm-a",
            run_id="prod",
            ts=ts,
            request_id=f"r{i}",
            status=status,
            prompt_tokens=p,
            output_tokens=o,
            queue_s=0.0,
            prefill_s=0.1,
            decode_s=max(0.0, e2e - 0.1),
            e2e_s=e2e,
        )
        for i, (ts, e2e, p, o, status) in enumerate(rows)
    ]
    store_events(db, events, key_prefix="prod")
    opts = WL.WorkloadOptions(time_scale=2.0, max_total_tokens=512)
    recorded = WL.recorded_traffic(db, opts, instances=["vllm-a"], start=0.0, end=200.0)
    assert [r.arrival_s for r in recorded.requests] == pytest.approx([0.0, 0.5, 1.5, 2.95])
    assert [(r.prompt_tokens, r.output_tokens) for r in recorded.requests] == [
        (300, 40),  # arrived at 100 - 2 = 98
        (412, 100),  # arrived at 99, replayed twice as fast; 900 + 100 tokens clipped to 512
        (20, 5),
        (50, 40),  # refused (demand too): its output is the finished requests' median
    ]
    assert (recorded.unfinished, recorded.filled, recorded.user_arrivals) == (1, 1, 0)
    with pytest.raises(WL.WorkloadError, match="holds 0 requests of other"):
        WL.recorded_traffic(db, opts, instances=["other"], start=0.0, end=200.0)
    db.dispose()


def test_simulated_vllm_trial_maps_the_engine_arguments(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    steps = stored_steps(db, start=0, end=1)
    assert steps == []
    store_events(db, _synthetic_steps(300), key_prefix="cal")
    profile = fit_profile(stored_steps(db, start=0, end=2e9), model=CKPT_MODEL, block_size=128)
    small_kv = VllmConfig(model="/m", kv_cache_memory_bytes=2 * 2**20, block_size=64, max_num_seqs=64)
    engine, _ = sim_vllm_engine(small_kv, profile)
    assert engine.kv.hot.num_pages == 2 * 2**20 // (64 * 2048) and engine.kv.page_tokens == 64
    assert engine.kv.watermark_pages == 0 and engine.kv.cold.num_pages == 0
    assert engine.config.scheduler.preemption_mode == "recompute" and not engine.config.scheduler.chunk_lone_prefill
    assert engine.model_cfg.max_position == 512
    opts = WL.WorkloadOptions(requests=60, scale=8.0, output_range=(16, 128), max_total_tokens=512)
    backend = VllmSimBackend(profile, lambda seed: WL.scenario("burst", 20.0, opts, seed=seed), db, SLO(ttft_s=2.0))
    roomy = backend.evaluate(VllmConfig(model="/m"), run_id="sim-roomy", seed=0)
    tight = backend.evaluate(small_kv, run_id="sim-tight", seed=0)
    sent = len(backend.requests(0)[0])
    assert roomy.finished == tight.finished == sent and roomy.rejected == 0
    assert tight.preemptions > roomy.preemptions  # 16 blocks of 64 tokens hold less of the burst than 64 of 128
    assert tight.oom == 0 and tight.e2e_p99_s > roomy.e2e_p99_s  # recomputed, as vLLM does, not an OOM
    assert backend.evaluate(VllmConfig(model="/m"), run_id="again", seed=0) is roomy and backend.cache_hits == 1
    db.dispose()


def test_a_resumed_request_in_vllms_generation_count_is_prefill_work() -> None:
    from tuner.vllm.calibrate import step_shape

    def step(num_seqs: int, prefill: int, decode: int) -> StoredStep:
        return StoredStep("r", "vllm-a", 0.0, 1, 0.01, num_seqs, prefill, decode, 4, 64)

    plain = step_shape(step(5, 100, 4), 128)  # one prompt chunk and four decodes: as logged
    assert (plain.prefill_tokens, plain.prefill_seqs, plain.decode_seqs) == (100, 1, 4)
    # vLLM logs a preempted request recomputing 296 tokens as a generation request (it has output tokens)
    resumed = step_shape(step(5, 0, 300), 128)
    assert (resumed.prefill_tokens, resumed.prefill_seqs, resumed.decode_seqs) == (296, 1, 4)
    both = step_shape(step(6, 64, 205), 128)  # a prompt chunk, a resumption of 201 tokens, four decodes
    assert (both.prefill_tokens, both.prefill_seqs, both.decode_seqs) == (265, 2, 4)
    assert step_shape(step(3, 0, 3), 128).decode_seqs == 3


def test_fidelity_simulates_the_traffic_the_client_sent(sqlite_url: str) -> None:
    """A client that sent late offered vLLM later traffic than the plan: the comparison simulates what was sent
    (and keeps the planned comparison apart), so the client's lag is not counted as the simulator's error."""
    from types import SimpleNamespace

    from tuner.vllm.fidelity import as_sent, compare

    db = make_engine(sqlite_url)
    store_events(db, _synthetic_steps(300), key_prefix="cal")
    profile = fit_profile(stored_steps(db, start=0, end=2e9), model=CKPT_MODEL, block_size=128)
    # deterministic, and a step row's duration is the forward alone as in vLLM's line: the "real" run is the simulator
    profile = profile.model_copy(update={"step_jitter": None, "overhead_s": 0.0, "overhead_per_seq_s": 0.0})
    opts = WL.WorkloadOptions(requests=60, scale=8.0, output_range=(16, 128), max_total_tokens=512)
    plan = WL.scenario("mixed", 20.0, opts, seed=0)
    start = 1_800_000_000.0
    sent_at = [start + r.arrival_s + 0.5 * r.arrival_s for r in plan]  # the client falls behind as it goes
    sent_at[3] = None  # never sent: keeps its planned time
    late = as_sent(plan, sent_at, start)
    assert late[3] == plan[3] and late[10].arrival_s == pytest.approx(1.5 * plan[10].arrival_s)
    with pytest.raises(ValueError, match="send times"):
        as_sent(plan, sent_at[:-1], start)
    cfg = VllmConfig(model="/m")
    real_sim = VllmSimBackend(profile, lambda _seed: late, db, SLO(ttft_s=2.0), instance="real", keep_steps=True)
    real = real_sim.evaluate(cfg, run_id="real", seed=0)
    window = real_sim.last_replay
    assert window is not None
    ev = {
        "run_id": "real",
        "config": cfg,
        "seed": 0,
        "start": window.wall_start,
        "end": window.wall_end + 1e-3,
        "metrics": SimpleNamespace(throughput_tps=real.throughput_tps, e2e_p99_s=real.e2e_p99_s, ttft_p99_s=1.0),
        "sent_at": [None if t is None else t - start + window.wall_start for t in sent_at],
    }
    out = compare([ev], profile, lambda _seed: plan, db, SLO(ttft_s=2.0), calibrated_on=cfg)
    row = out["replays"][0]
    assert row["as_sent"] and row["in_sample"]
    assert row["error"]["throughput"] < 0.02 and row["error"]["busy"] < 0.02
    assert row["error_planned"]["throughput"] > 0.2  # the plan ends a third sooner than what was sent
    assert out["summary"]["planned"]["throughput"]["median"] == row["error_planned"]["throughput"]
    assert out["summary"]["all"]["throughput"]["median"] == row["error"]["throughput"]
    without = compare([{**ev, "sent_at": None}], profile, lambda _seed: plan, db, SLO(ttft_s=2.0))
    assert not without["replays"][0]["as_sent"]
    assert without["replays"][0]["error"] == without["replays"][0]["error_planned"]
    db.dispose()
