"""Block manager invariants under random operation sequences (hypothesis state machine), plus the
prefix cache, tiers and exact waste/fragmentation accounting on hand-made cases."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import CacheConfig
from engine.kv import KVCacheManager
from engine.kv.manager import KVCacheError
from engine.kv.policy import BlockSizePolicy

BPT = 64  # bytes per token of a made-up model: one page of 8 tokens = 512 bytes


def manager(pages: int = 64, cold_pages: int = 64, **cache: object) -> KVCacheManager:
    cfg = CacheConfig(hot_bytes=pages * 8 * BPT, cold_bytes=cold_pages * 8 * BPT, **cache)
    return KVCacheManager(cfg, bytes_per_token=BPT, watermark=0.0)


def test_dynamic_policy_sizes_by_position() -> None:
    p = BlockSizePolicy.from_config(CacheConfig(block_policy="dynamic"))
    assert [p.size_at(x) for x in (0, 511, 512, 2047, 2048)] == [16, 16, 32, 32, 64]
    layout = p.layout(0, 600)
    assert layout[0] == (0, 16) and layout[-1][1] == 32 and sum(s for _, s in layout) >= 600


def test_internal_waste_is_exact() -> None:
    kv = manager(block_size=32)
    alloc = kv.allocate(0, "a", list(range(40)), budget=40)
    assert alloc is not None and alloc.num_new_tokens == 40
    kv.commit(0, list(range(40)), 40)
    st_ = kv.stats()
    assert kv.block_sizes(0) == [32, 32]
    assert st_.internal_waste == pytest.approx(1 - 40 / 64)
    kv.check_invariants()


def test_prefix_cache_reuses_full_blocks_and_counts_hits() -> None:
    kv = manager(block_size=16)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    kv.allocate(0, "a", prompt, budget=50)
    kv.commit(0, prompt, 50)
    kv.free(0)
    assert kv.cached_pages == 6  # 3 blocks x 2 pages stay cached
    other = [*prompt[:40], 1, 2, 3]
    alloc = kv.allocate(1, "b", other, budget=100)
    assert alloc.cached_tokens == 32 and alloc.num_new_tokens == len(other) - 32
    assert kv.stats().prefix_hits == 1
    kv.check_invariants()
    # a prompt that is entirely cached still recomputes its last token
    kv.free(1)
    alloc = kv.allocate(2, "c", prompt[:32], budget=100)
    assert alloc.cached_tokens == 16 and alloc.num_new_tokens == 16
    kv.check_invariants()


def test_reset_prefix_cache_makes_a_replay_start_cold() -> None:
    kv = manager(block_size=16)
    prompt, held = list(range(100, 150)), list(range(300, 340))
    for seq_id, tokens in ((0, prompt), (1, held)):
        kv.allocate(seq_id, str(seq_id), tokens, budget=100)
        kv.commit(seq_id, tokens, len(tokens))
    kv.free(0)  # cached, nobody holds it; sequence 1 still runs
    assert kv.reset_prefix_cache() == 6 and kv.cached_pages == 0
    assert kv.allocate(2, "again", prompt, budget=100).cached_tokens == 0
    kv.free(1)  # its blocks were held during the reset, so they stayed cached
    assert kv.allocate(3, "held", held, budget=100).cached_tokens == 32
    kv.check_invariants()


def test_cached_blocks_are_evicted_lru_when_memory_runs_out() -> None:
    kv = manager(pages=16, block_size=16)  # 128 tokens
    first = list(range(64))
    kv.allocate(0, "a", first, budget=64)
    kv.commit(0, first, 64)
    kv.free(0)
    assert kv.hot.used_pages == 8  # all cached
    fresh = [7] * 120
    assert kv.allocate(1, "b", fresh, budget=120) is not None  # forces eviction of the cached blocks
    assert kv.cached_pages == 0
    kv.check_invariants()


def test_swap_round_trip_preserves_layout_and_accounting() -> None:
    kv = manager(block_policy="dynamic")
    toks = list(range(300))
    kv.allocate(0, "a", toks, budget=300)
    kv.commit(0, toks, 300)
    sizes = kv.block_sizes(0)
    plan = kv.swap_out(0)
    assert plan is not None and plan.direction == "out" and kv.tier_of(0) == "cold"
    assert plan.num_pages == sum(sizes) // 8
    assert kv.hot.used_pages == kv.cached_pages  # only cached copies remain hot
    back = kv.swap_in(0)
    assert back is not None and kv.tier_of(0) == "hot" and kv.block_sizes(0) == sizes
    assert kv.cold.used_pages == 0
    kv.check_invariants()


def test_swap_out_fails_cleanly_when_cold_tier_is_full() -> None:
    kv = manager(cold_pages=0)
    kv.allocate(0, "a", list(range(20)), budget=20)
    assert kv.swap_out(0) is None
    assert kv.tier_of(0) == "hot"
    kv.check_invariants()


def test_misuse_raises_specific_errors() -> None:
    kv = manager()
    with pytest.raises(KVCacheError):
        kv.free(42)
    kv.allocate(0, "a", [1, 2, 3], budget=3)
    with pytest.raises(KVCacheError):
        kv.allocate(0, "a", [1, 2, 3], budget=3)
    with pytest.raises(KVCacheError):
        kv.swap_in(0)


def test_trace_reports_every_operation() -> None:
    events: list[tuple] = []
    kv = manager(pages=16, block_size=16)
    kv.trace = lambda *e: events.append(e)
    toks = list(range(40))
    kv.allocate(0, "a", toks, budget=40)
    kv.commit(0, toks, 40)
    kv.swap_out(0)
    kv.swap_in(0)
    kv.free(0)
    ops = [e[0] for e in events]
    assert ops[0] == "alloc" and "swap_out" in ops and "swap_in" in ops
    assert sum(e[2] for e in events if e[0] == "alloc") == 3


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / commit / free / swap / evict; exact accounting after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = manager(pages=48, cold_pages=32, block_policy="dynamic", dynamic_thresholds=(24, 64))
        self.seqs: dict[int, list[int]] = {}  # seq_id -> tokens
        self.computed: dict[int, int] = {}
        self.next_id = 0

    @rule(length=st.integers(1, 120), shared=st.booleans(), budget=st.integers(1, 200))
    def allocate(self, length: int, shared: bool, budget: int) -> None:
        toks = ([5] * 40 + list(range(length))) if shared else [self.next_id % 250] * length
        alloc = self.kv.allocate(self.next_id, f"r{self.next_id}", toks, budget)
        if alloc is not None:
            assert alloc.cached_tokens < len(toks)
            self.seqs[self.next_id] = toks
            self.computed[self.next_id] = alloc.cached_tokens + alloc.num_new_tokens
            self.kv.commit(self.next_id, toks, self.computed[self.next_id])
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 10**6), grow=st.integers(1, 40))
    def append(self, pick: int, grow: int) -> None:
        sid = sorted(self.seqs)[pick % len(self.seqs)]
        if self.kv.tier_of(sid) != "hot":
            return
        toks = self.seqs[sid]
        toks.extend([sid % 250] * grow)
        target = len(toks)
        if self.kv.append_slots(sid, target):
            self.computed[sid] = target
            self.kv.commit(sid, toks, target)
        else:
            del toks[-grow:]

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick: int) -> None:
        sid = sorted(self.seqs)[pick % len(self.seqs)]
        self.kv.free(sid)
        del self.seqs[sid], self.computed[sid]

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 10**6))
    def swap(self, pick: int) -> None:
        sid = sorted(self.seqs)[pick % len(self.seqs)]
        if self.kv.tier_of(sid) == "hot":
            self.kv.swap_out(sid)
        else:
            self.kv.swap_in(sid)

    @rule(pages=st.integers(1, 20))
    def evict(self, pages: int) -> None:
        self.kv.evict(pages)

    @invariant()
    def accounting_is_exact(self) -> None:
        self.kv.check_invariants()
        s = self.kv.stats()
        assert 0.0 <= s.internal_waste < 1.0 and 0.0 <= s.fragmentation <= 1.0
        assert s.hot_pages_used <= s.hot_pages_total


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKVStateMachine = KVMachine.TestCase
