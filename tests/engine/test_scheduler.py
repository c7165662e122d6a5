"""Scheduler behaviour on the real scheduler and KV manager, with a scripted executor (no model)."""

from __future__ import annotations

import pytest

from engine.clock import VirtualClock
from engine.config import CacheConfig, RecyclerConfig, SchedulerConfig
from engine.kv import KVCacheManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, SeqStatus, Sequence, StageTimes

BPT = 64


def make(pages: int = 64, cold_pages: int = 64, **sched: object) -> Scheduler:
    cache = CacheConfig(hot_bytes=pages * 8 * BPT, cold_bytes=cold_pages * 8 * BPT, block_size=16)
    kv = KVCacheManager(cache, bytes_per_token=BPT, watermark=0.0)
    return Scheduler(SchedulerConfig(**sched), RecyclerConfig(), kv, eos_token_id=257, max_model_len=4096)


def seq(i: int, n: int = 10, *, prio: int = 1, at: float = 0.0, out: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    return Sequence(i, f"r{i}", [i % 200 + 1] * n, params, prio, StageTimes(at))


def run_step(s: Scheduler, now: float) -> list[Sequence]:
    out = s.schedule(now)
    toks = [7 if item.samples else None for item in out.scheduled]
    s.update(out, toks, now)
    s.kv.check_invariants()
    return [item.seq for item in out.scheduled]


def test_higher_priority_is_admitted_first_fcfs_inside_a_class() -> None:
    s = make(max_num_seqs=2)
    for i, prio in enumerate([2, 1, 0, 0]):
        s.add(seq(i, prio=prio, at=i * 0.001))
    first = run_step(s, 0.01)
    assert [q.seq_id for q in first] == [2, 3]


def test_aging_stops_starvation() -> None:
    s = make(max_num_seqs=1, aging_s=1.0)
    low = seq(0, prio=2, at=0.0, out=1)
    s.add(low)
    served_low_at = None
    t = 0.0
    i = 1
    while served_low_at is None and t < 10:
        s.add(seq(i, prio=0, at=t, out=1))  # a steady stream of high-priority work
        i += 1
        ran = run_step(s, t)
        if low in ran:
            served_low_at = t
        t += 0.25
    assert served_low_at is not None and served_low_at <= 2.5  # two classes of aging at 1 s each


def test_token_budget_and_chunked_prefill() -> None:
    s = make(max_num_batched_tokens=64, prefill_chunk_tokens=32)
    s.add(seq(0, n=100))
    out = s.schedule(0.0)
    assert [(i.start, i.num_new_tokens, i.samples) for i in out.scheduled] == [(0, 32, False)]
    s.update(out, [None], 0.0)
    out = s.schedule(0.1)
    assert [(i.start, i.num_new_tokens) for i in out.scheduled] == [(32, 32)]


def test_preempts_worst_priority_then_latest_arrival_recompute() -> None:
    s = make(pages=16, max_num_seqs=8)  # 128 tokens of KV
    seqs = [
        seq(0, n=30, prio=0, at=0.0, out=200),
        seq(1, n=30, prio=2, at=0.1, out=200),
        seq(2, n=30, prio=1, at=0.2, out=200),
        seq(3, n=30, prio=1, at=0.3, out=200),
    ]
    for q in seqs:
        s.add(q)
    t = 1.0
    while not any(q.preemptions for q in seqs):
        run_step(s, t)
        t += 0.01
    assert seqs[1].preemptions == 1  # the low-priority one goes first
    assert seqs[1].status == SeqStatus.WAITING and seqs[1].num_computed_tokens == 0
    assert seqs[0].preemptions == 0


def test_swap_preemption_moves_to_cold_tier_and_comes_back() -> None:
    s = make(pages=16, cold_pages=64, max_num_seqs=8, preemption_mode="swap")
    a, b = seq(0, n=40, prio=0, out=300), seq(1, n=40, prio=1, at=0.1, out=300)
    s.add(a)
    s.add(b)
    t = 0.0
    while not b.swaps:
        run_step(s, t)
        t += 0.01
    assert b.status == SeqStatus.SWAPPED and s.kv.tier_of(1) == "cold"
    s.abort(a)  # room again
    run_step(s, t)
    assert b.status == SeqStatus.RUNNING and s.kv.tier_of(1) == "hot"


def test_active_recycler_evicts_cached_blocks_above_threshold() -> None:
    s = make(pages=32)
    s.recycler.cfg = RecyclerConfig(mode="active", threshold=0.2, recycle_interval_ms=1)
    q = seq(0, n=200, out=1)
    s.add(q)
    t = 0.0
    while q.status != SeqStatus.FINISHED:
        run_step(s, t)
        t += 0.01
    assert s.kv.cached_pages > 0
    s.schedule(t + 1.0)
    assert s.kv.occupancy() <= 0.2 and s.recycler.pages_recycled > 0


def test_aggressive_recycler_swaps_idle_sequences_worst_first_skipping_what_does_not_fit() -> None:
    s = make(pages=64, cold_pages=16, max_num_batched_tokens=128, prefill_chunk_tokens=128)
    best, middle, worst = seq(1, n=20, out=100), seq(2, n=50, at=0.1, out=100), seq(3, n=85, at=0.2, out=100)
    for q in (best, middle, worst):
        s.add(q)
    t = 0.0
    for _ in range(3):
        run_step(s, t)
        t += 0.01
    assert [len(s.kv.pages(q.seq_id)) for q in (best, middle, worst)] == [4, 8, 12]  # the cold tier holds 16
    # a long high-priority prefill now takes the whole budget, so the three sit idle from the next step on
    cfg = s.cfg.model_copy(update={"max_num_batched_tokens": 16, "prefill_chunk_tokens": 16})
    s.reconfigure(cfg, RecyclerConfig(mode="aggressive", threshold=0.1, recycle_interval_ms=1))
    s.add(seq(0, n=300, prio=0, at=0.5, out=4))
    for _ in range(3):
        run_step(s, t)
        t += 0.01
    # worst first: `worst` (12 pages) fits, `middle` (8) no longer does and stays running, `best` (4) fills the tier
    assert [q.status for q in (best, middle, worst)] == [SeqStatus.SWAPPED, SeqStatus.RUNNING, SeqStatus.SWAPPED]
    assert s.kv.cold.used_pages == 16 and s.total_idle_swaps == 2 and middle.swaps == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_everything_finishes_under_memory_pressure(mode: str) -> None:
    s = make(pages=32, cold_pages=32, max_num_seqs=16, preemption_mode=mode)
    seqs = [seq(i, n=20 + 7 * i, prio=i % 3, at=i * 0.01, out=40) for i in range(12)]
    for q in seqs:
        s.add(q)
    clock = VirtualClock()
    for _ in range(5000):
        if not s.num_unfinished:
            break
        run_step(s, clock.now())
        clock.advance(0.01)
    assert all(q.status == SeqStatus.FINISHED and q.num_output_tokens == 40 for q in seqs)
    assert sum(q.preemptions for q in seqs) > 0
    assert s.kv.hot.used_pages == s.kv.cached_pages and s.kv.cold.used_pages == 0
